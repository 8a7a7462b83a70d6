"""Synthetic workloads for the benchmarks: generated here, nothing downloaded.

Texts are built from common English words, which the SmolLM2 tokenizer maps to about
one token each, so `handbook(1500)` is a ~1,500-token document.
"""

from __future__ import annotations

import random
from typing import List

WORDS = ("the of and to in is for that on with as it by this be are from at or an was have not "
         "policy employee manager team office leave request approval travel expense report safety "
         "security access badge laptop data customer privacy training review salary holiday week "
         "month year day hour meeting project deadline budget contract vendor invoice payment "
         "equipment software account password support ticket incident response backup server "
         "network email phone remote home schedule shift overtime benefit health insurance dental "
         "vision plan retirement bonus promotion performance goal feedback conduct ethics gift "
         "conflict interest complaint process form portal system record file document section").split()

TOPICS = ["travel expenses", "parental leave", "laptop security", "remote work", "overtime pay",
          "data privacy", "incident reporting", "vendor contracts", "performance reviews", "badge access",
          "holiday schedule", "health insurance", "password rules", "gift policy", "meeting rooms"]


def words(n: int, rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def handbook(num_tokens: int, seed: int = 1234) -> str:
    """A long shared document: numbered sections of plausible policy text."""
    rng = random.Random(seed)
    parts, count, section = ["Employee Handbook."], 2, 1
    while count < num_tokens:
        topic = TOPICS[section % len(TOPICS)]
        body = words(min(60, num_tokens - count), rng)
        parts.append(f"Section {section}: {topic}. {body}.")
        count += len(body.split()) + 5
        section += 1
    return "\n".join(parts)


def questions(n: int, rng: random.Random) -> List[str]:
    forms = ["What does the handbook say about {}?", "Who approves {}?", "Summarize the rules on {}.",
             "How do I request {}?", "Is there a limit on {}?"]
    return [rng.choice(forms).format(rng.choice(TOPICS)) + f" (case {i})" for i in range(n)]


def random_prompts(n: int, num_tokens: int, rng: random.Random) -> List[str]:
    """Prompts that share nothing: each starts with its own id and random words."""
    return [f"Request {i} {rng.random():.6f}: " + words(num_tokens, rng) for i in range(n)]
