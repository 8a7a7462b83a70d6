"""Synthetic workloads for the benchmarks: generated here, nothing downloaded.

Texts are built from common English words, which the SmolLM2 tokenizer maps to about
one token each, so `handbook(1500)` is a ~1,500-token document.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import List, Tuple

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


# --- serving datasets (bench_serving, baselines/hf_generate) ------------------------------------

@dataclass(frozen=True)
class Request:
    """One serving request: the prompt, its estimated token count and the tokens to generate."""

    prompt: str
    prompt_len: int   # estimate (~1 token per word); servers report the exact count
    output_len: int
    group: int = -1   # shared-prefix group, -1 where nothing is shared


def _length(target: int, range_ratio: float, rng: random.Random) -> int:
    """Uniform in [max(int(target * range_ratio), 1), target], as SGLang's `random` dataset."""
    return rng.randint(max(int(target * range_ratio), 1), max(target, 1))


def random_requests(n: int, input_len: int, output_len: int, range_ratio: float,
                    rng: random.Random) -> List[Request]:
    out = []
    for i in range(n):
        length = _length(input_len, range_ratio, rng)
        prompt = f"Request {i}: " + words(max(length - 3, 1), rng)
        out.append(Request(prompt, length, _length(output_len, range_ratio, rng)))
    return out


def shared_prefix_requests(num_groups: int, prompts_per_group: int, system_len: int, question_len: int,
                           output_len: int, rng: random.Random, ordered: bool = False) -> List[Request]:
    """SGLang's generated-shared-prefix: groups of prompts `system + "\\n\\n" + question`."""
    out = []
    for g in range(num_groups):
        system = f"System prompt {g}. You are assistant number {g}. " + words(max(system_len - 12, 1), rng)
        for q in range(prompts_per_group):
            question = f"Question {q}: " + words(max(question_len - 3, 1), rng)
            out.append(Request(system + "\n\n" + question, system_len + question_len + 1, output_len, g))
    if not ordered:
        rng.shuffle(out)
    return out


def document_assistant_requests(n: int, doc_tokens: int, output_len: int, rng: random.Random) -> List[Request]:
    """One long handbook shared by every request, each with its own question."""
    doc = handbook(doc_tokens)
    return [Request(doc + "\n\nQuestion: " + q + "\nAnswer:", doc_tokens + 16, output_len, 0)
            for q in questions(n, rng)]


# --- program workloads (bench_programs) -----------------------------------------------------------

SUBJECTS = ("addition", "subtraction", "multiplication", "comparison")


def arithmetic_question(subject: str, rng: random.Random) -> Tuple[str, List[str], int]:
    """(question, four options, index of the right one) — answers are checkable."""
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    if subject == "addition":
        q, right = f"What is {a} + {b}?", a + b
    elif subject == "subtraction":
        q, right = f"What is {max(a, b)} - {min(a, b)}?", abs(a - b)
    elif subject == "multiplication":
        a, b = a % 12 + 2, b % 12 + 2
        q, right = f"What is {a} times {b}?", a * b
    else:
        q, right = f"Which number is larger than {a} and smaller than {a + 10}?", a + rng.randint(1, 9)
    options = {right}
    while len(options) < 4:
        options.add(max(0, right + rng.choice((-1, 1)) * rng.randint(1, 12)))
    options = sorted(options)
    return q, [str(o) for o in options], options.index(right)


def mmlu_items(n: int, rng: random.Random, context_words: int = 40) -> List[dict]:
    """MMLU-style items: a 5-shot prefix per subject (shared), one question each, letter answer."""
    shots = {}
    for subject in SUBJECTS:
        examples = []
        for _ in range(5):
            q, options, right = arithmetic_question(subject, rng)
            examples.append({"context": words(context_words, rng), "question": q, "options": options,
                             "answer": "ABCD"[right]})
        shots[subject] = examples
    items = []
    for i in range(n):
        subject = SUBJECTS[i % len(SUBJECTS)]
        q, options, right = arithmetic_question(subject, rng)
        items.append({"subject": subject, "shots": shots[subject], "context": words(context_words, rng),
                      "question": q, "options": options, "answer": "ABCD"[right]})
    return items


def hellaswag_items(n: int, rng: random.Random, num_shots: int = 5) -> Tuple[List[dict], List[dict]]:
    """(few-shot examples, items): a context and four endings, the right one continues its topic."""
    def item():
        topic, others = rng.choice(TOPICS), rng.sample(TOPICS, 4)
        context = f"The manager explained the rules on {topic}. " + words(24, rng) + ". Then she"
        endings = [f" asked the team to read the section on {topic} before the meeting."]
        endings += [f" {words(6, rng)} {o} {words(4, rng)}." for o in others if o != topic][:3]
        order = list(range(4))
        rng.shuffle(order)
        return {"context": context, "endings": [endings[k] for k in order], "label": order.index(0)}
    return [item() for _ in range(num_shots)], [item() for _ in range(n)]


def people_sentences(n: int, rng: random.Random) -> List[str]:
    names = ("Ann", "Bob", "Chen", "Dara", "Eli", "Fatima", "Goro", "Hana", "Ivan", "Jo")
    cities = ("Paris", "Lima", "Oslo", "Cairo", "Tokyo", "Quito", "Perth", "Accra")
    return [f"{rng.choice(names)} is {rng.randint(18, 80)} years old, lives in {rng.choice(cities)} and "
            f"works on {rng.choice(TOPICS)}. {words(20, rng)}." for _ in range(n)]


def chat_turns(n: int, rng: random.Random) -> List[Tuple[str, str]]:
    firsts = questions(n, rng)
    return [(q, "Now give one example about " + rng.choice(TOPICS) + ".") for q in firsts]


def reasoning_problems(n: int, rng: random.Random) -> List[str]:
    return [f"A team has {rng.randint(3, 40)} members and a budget of {rng.randint(2, 90) * 100} dollars for "
            f"{rng.choice(TOPICS)}. Each member needs {rng.randint(20, 300)} dollars. "
            f"How should the manager plan the spending?" for _ in range(n)]
