"""Compressed FSM (jump-forward): tokenizing forced text.

The forced string itself comes from the grammar (outlines: the byte DFA's
`ByteDFA.forced_bytes`: from a non-accepting state with exactly one live byte, that byte
is forced), the same automaton the token masks are read from, so a jump never disagrees
with the masks.

The scheduler drafts `forced_token_ids` (scheduler/jump_forward.py: the model verifies
them, so outputs stay exact). `jump_forward_retokenize` is the committing variant, which
rewrites the output's tail canonically (Grammar.jump_and_retokenize pairs with it).
"""
from __future__ import annotations

from typing import Sequence


RETOKENIZE_WINDOW = 16  # trailing output tokens re-tokenized together with the forced text
CONTEXT_TOKENS = 5       # tokens before the window given to the tokenizer as left context


def jump_forward_retokenize(tokenizer, output_ids: Sequence[int], jump_str: str,
                            prompt_tail_ids: Sequence[int] = (),
                            window: int = RETOKENIZE_WINDOW) -> tuple[int, list[int]]:
    """Re-tokenize the output's last `window` tokens plus `jump_str` canonically.

    Returns (keep, new_ids): the output becomes `output_ids[:keep] + new_ids`, with
    keep >= len(output_ids) - window. Tokens before the window are never rewritten, so a
    jump costs O(window + len(jump_str)), not O(output): pre-tokenization splits text at
    spaces and punctuation, and a merge across more than `window` tokens does not occur
    in practice. The tokens before the window (or the prompt's tail) give the tokenizer
    its left context; if the window's first token would fuse with them, the window is
    tokenized on its own instead.
    """
    start = max(0, len(output_ids) - window)
    context = (list(prompt_tail_ids) + list(output_ids[:start]))[-CONTEXT_TOKENS:]
    keep, new_ids = _retokenize(tokenizer, list(output_ids[start:]), jump_str, context)
    return start + keep, new_ids


def forced_token_ids(tokenizer, jump_str: str, tail_ids: Sequence[int] = ()) -> list[int]:
    """Tokens spelling exactly `jump_str` after the tokens `tail_ids` (the output's last
    few, as left context), leaving those unchanged: the canonical tokenization of
    tail + jump_str when it keeps the tail's tokens, else that of jump_str alone."""
    keep, ids = _retokenize(tokenizer, [], jump_str, list(tail_ids))
    assert keep == 0
    return ids


def _retokenize(tokenizer, ids_in: list, jump_str: str, tail: list) -> tuple[int, list[int]]:
    text = tokenizer.decode(ids_in, skip_special_tokens=False) + jump_str
    ids = None
    if tail:
        prefix = tokenizer.decode(tail, skip_special_tokens=False)
        joined = tokenizer.encode(prefix + text, add_special_tokens=False)
        if joined[: len(tail)] == tail:
            ids = joined[len(tail):]
    if ids is None:
        ids = tokenizer.encode(text, add_special_tokens=False)
    keep = 0
    for a, b in zip(ids_in, ids):
        if a != b:
            break
        keep += 1
    return keep, list(ids[keep:])
