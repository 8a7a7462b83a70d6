"""Compressed FSM (jump-forward): canonical re-tokenization of forced text.

The forced string itself comes from the grammar's byte DFA (`ByteDFA.forced_bytes`: from
a non-accepting state with exactly one live byte, that byte is forced), the same
automaton the token masks are read from, so a jump never disagrees with the masks.
"""
from __future__ import annotations

from typing import Sequence


def jump_forward_retokenize(tokenizer, output_ids: Sequence[int], jump_str: str,
                            prompt_tail_ids: Sequence[int] = ()) -> tuple[int, list[int]]:
    """Re-tokenize `decode(output_ids) + jump_str` canonically.

    Returns (keep, new_ids): the output becomes `output_ids[:keep] + new_ids`. The prompt's
    tail gives the tokenizer its left context; if the output's first token would fuse
    with the prompt, the output is tokenized on its own instead.
    """
    text = tokenizer.decode(list(output_ids), skip_special_tokens=False) + jump_str
    ids = None
    tail = list(prompt_tail_ids)
    if tail:
        prefix = tokenizer.decode(tail, skip_special_tokens=False)
        joined = tokenizer.encode(prefix + text, add_special_tokens=False)
        if joined[: len(tail)] == tail:
            ids = joined[len(tail):]
    if ids is None:
        ids = tokenizer.encode(text, add_special_tokens=False)
    keep = 0
    for a, b in zip(output_ids, ids):
        if a != b:
            break
        keep += 1
    return keep, list(ids[keep:])
