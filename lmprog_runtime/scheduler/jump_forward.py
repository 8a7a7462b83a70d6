"""Jump-forward, exact: the text a grammar forces is drafted, never committed unseen.

Before admission, for every running constrained request at a plain decode step, the
grammar's forced string (`Grammar.jump_forward_str()`, from any backend) is tokenized as
a continuation of the output (constrained/jump_forward.py: `forced_token_ids`) and
planned as a draft of the verify step speculative decoding uses (batch.py, verify.py):
the step's one forward computes the last token plus the forced tokens, and the model
keeps the longest prefix it would have produced itself, then its own next token (the
bonus). Greedy outputs are therefore token-identical to jump-forward off, and sampling
follows the same distribution (rejection sampling of a deterministic draft).

Token healing falls out of it: where the forced text ends inside a token the model
would write (`"name"` followed by `":`, `because` followed by ` the`), the model rejects
the partial last token(s) of the draft and writes its own token instead, under the
grammar's mask at that position, which allows exactly the tokens consistent with the
remaining forced bytes. No emitted token is ever rewritten: output_ids only grow, so
the detokenizer, the logprobs and the radix cache never see a token that later changes;
KV of rejected draft positions is freed through KVManager.truncate after the verify.

Whitespace policy: only bytes the grammar forces are drafted (a state with exactly one
live byte), so optional whitespace (JSON's whitespace pattern, `\\s*` in a regex) is never
forced; forced whitespace is kept only where the model writes it.

A request drafts when its only pending token is its last output token and at least 2
output tokens are left (`_eligible`). Penalties and min_new_tokens apply in every verify
row as in a plain step (speculative/verify.py counts the output up to that row).
"""

from __future__ import annotations

from typing import Dict, List, Optional

import numpy as np
import torch

from lmprog_runtime.constrained.jump_forward import CONTEXT_TOKENS, forced_token_ids
from lmprog_runtime.scheduler.batch import PlannedDraft
from lmprog_runtime.scheduler.faults import Stage, fail_request


def _eligible(r) -> bool:
    g = r.grammar
    return (g is not None and not r.finished and r.extend_len == 1 and r.kv_len >= r.prompt_len
            and bool(r.output_ids) and r.max_new_tokens - len(r.output_ids) >= 2
            and not g.is_terminated())


def draft_limit(r) -> int:
    """Most draft tokens `r` may verify: k drafts make up to k + 1 tokens (<= the tokens
    left). Penalties and min_new_tokens need no limit: each verify row sees the output
    as it stands there (speculative/verify.py `_row_views`)."""
    return r.max_new_tokens - len(r.output_ids) - 1


def grammar_draft(g, tokens: List[int], vocab_size: int, cut_after=None):
    """Walk the matcher `g` through `tokens` and back: (kept, mask) with `kept` the
    prefix the grammar allows, cut before a token after which it terminates or
    `cut_after(g)` holds (that token may still come as the bonus, through on_token), and
    mask bool [len(kept) + 1, vocab_size], row i = the mask after kept[:i]."""
    rows = np.empty((len(tokens) + 1, vocab_size), dtype=np.bool_)
    kept = 0
    try:
        for i, t in enumerate(tokens):
            g.write_mask(rows[i])  # the state after tokens[:i]
            if not (0 <= t < vocab_size and rows[i][t]):
                break
            g.accept_token(t)
            if g.is_terminated() or (cut_after is not None and cut_after(g)):
                g.rollback(1)
                break
            kept += 1
        else:
            g.write_mask(rows[kept])
    finally:
        g.rollback(kept)
    while kept and not rows[kept].any():  # a draft into a dead end: no verify row samples from nothing
        kept -= 1
    return tokens[:kept], torch.from_numpy(rows[:kept + 1])


class JumpForward:
    """Plans forced-text drafts (see the module docstring); one per eligible request."""

    def __init__(self, tokenizer, vocab_size: int, stats: dict, faults=None):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stats = stats  # adds num_jump_forward_tokens (accepted), num_jump_forward_drafted
        self.faults = faults  # FaultInjector (tests only) or None

    def propose(self, running: List) -> Dict[int, object]:
        """id(req) → PlannedDraft(forced=True) for the requests whose grammar forces text;
        a request whose drafting raises fails alone (Stage.JUMP_FORWARD)."""
        out = {}
        for r in running:
            if not _eligible(r):
                continue
            try:
                if self.faults is not None:
                    self.faults.check(Stage.JUMP_FORWARD, r.rid)
                draft = self._draft(r)
            except Exception as e:
                fail_request(r, Stage.JUMP_FORWARD, e)
                continue
            if draft is not None:
                out[id(r)] = draft
        return out

    def _draft(self, r):
        jump = r.grammar.jump_forward_str()
        limit = draft_limit(r)
        if not jump or limit <= 0:
            return None
        tail = (r.origin_input_ids[-CONTEXT_TOKENS:] + r.output_ids[-CONTEXT_TOKENS:])[-CONTEXT_TOKENS:]
        tokens = forced_token_ids(self.tokenizer, jump, tail)[:limit]
        kept, mask = grammar_draft(r.grammar, tokens, self.vocab_size)
        if not kept:
            return None
        return PlannedDraft(kept, mask, forced=True)

    def after_verify(self, proposed: int, accepted: int) -> None:
        self.stats["num_jump_forward_drafted"] += proposed
        self.stats["num_jump_forward_tokens"] += accepted


def forced_drafts(jump: Optional[JumpForward], speculator, running: List) -> Dict[int, object]:
    """This step's drafts: forced text first; the speculator drafts for every request, and
    where the grammar forces text its draft replaces the forced one only when it goes further
    (its own draft through the forced text, or the forced tokens + its continuation)."""
    drafts = jump.propose(running) if jump is not None else {}
    if speculator is not None:
        drafts.update(speculator.propose(running, drafts))
    return drafts
