"""The draft-source contract: how the scheduler gets draft tokens, and tells the source
what became of them. A new source (an EAGLE-style head, a suffix tree, ...) implements
these three methods and is added to `create_draft_source`.

    drafts = source.propose(reqs, budgets, prefixes=None)   # one Draft (or None) per request
    source.on_verified(req, tokens)          # tokens appended by the verify step
    source.release(req)                      # the request finished: drop its state
    source.check_integrity() / source.flush()  # audit / empty its own memory (when idle)

`propose` sees running requests whose last token is their only pending one: the draft
continues `req.origin_input_ids + req.output_ids` (+ `prefixes[i]` when given: text the
request's grammar forces, which the verify step checks first; the draft continues after
it, and a source that cannot may return None there). `budgets[i]` bounds request i's
draft (>= 1). A source never changes a request; it reads its tokens. A source with
`guided = True` also gets `guides`: per request its grammar's GrammarGuide (guide.py; None
without a grammar), which says what may follow a draft being built.

`Draft.parents` describes a tree (parents[j] = index of token j's parent, -1 = the last
verified token; parents[j] < j, so every prefix of the draft is a tree too; siblings
carry distinct tokens). None: a chain (each token follows the previous one).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import List, Optional, Sequence


@dataclass
class Draft:
    tokens: List[int]                     # proposed continuation, len >= 1
    parents: Optional[List[int]] = None   # None: a chain


class DraftSource(abc.ABC):
    # A proposal costs only a lookup (no forward): the speculator then also drafts, every
    # few tokens, for requests it does not verify, to measure their acceptance (shadow.py).
    cheap = False
    # `propose` takes `guides` (see the module docstring; the speculator rolls them back).
    guided = False

    @abc.abstractmethod
    def propose(self, reqs: Sequence, budgets: Sequence[int],
                prefixes: Optional[Sequence[List[int]]] = None) -> List[Optional[Draft]]:
        """One draft (at most budgets[i] tokens, continuing after prefixes[i]) or None per request."""

    def on_verified(self, req, tokens: List[int], accepted_drafts: int) -> None:
        """`tokens` were appended to `req.output_ids` by a verify step: the first
        `accepted_drafts` were drafts, the last the target's bonus token."""

    def release(self, req) -> None:
        """`req` finished (or failed): forget it."""

    def check_integrity(self) -> None:
        """Audit the source's own memory (a draft model's KV pool); raise when broken."""

    def flush(self) -> None:
        """The scheduler is idle and flushes its caches: drop the source's too."""


def create_draft_source(spec, runner, server_args) -> DraftSource:
    """The source `spec.algorithm` names (imports lazily: STANDALONE loads a second model)."""
    if spec.algorithm == "NGRAM":
        from lmprog_runtime.speculative.ngram import NgramDraftSource
        return NgramDraftSource(max_depth=spec.ngram_max_trie_depth, capacity=spec.ngram_capacity,
                                topk=spec.topk)
    if spec.algorithm == "STANDALONE":
        from lmprog_runtime.speculative.standalone import StandaloneDraftSource
        return StandaloneDraftSource(spec, runner, server_args)
    raise ValueError(f"unknown speculative algorithm {spec.algorithm!r}")
