"""STANDALONE drafts: a smaller model with the same tokenizer, with its own runner, KV pool
and radix cache, drafting `num_steps` tokens autoregressively (greedy) per step.

Each target request has a shadow sequence here (`_DraftSeq`): the request's tokens plus
the drafts of the last step, with its own KV in the draft pool, moved only through the
draft side's own `KVManager`. At the next `propose` the shadow is synced to the request's
tokens: KV beyond their common prefix (rejected drafts, a jump-forward's rewrite) is
dropped, then the missing tokens are computed in the first draft forward (the whole prompt
the first time, in one forward: no chunking here), then one token per forward.

A shadow that cannot get a row or slots simply drafts nothing this step. A draft forward
that fails frees the KV of that forward's shadows and re-raises (the Speculator then
retries request by request; a request whose own draft fails finishes with an error).
The embedded tests run it with tiny random-weight draft models (plumbing only).
"""

from __future__ import annotations

import logging
from typing import Dict, List, Optional, Sequence

import torch

from lmprog_runtime.speculative.base import Draft, DraftSource

logger = logging.getLogger(__name__)


class _DraftSeq:
    """The fields KVManager and build_forward_batch read from a request."""

    def __init__(self, rid: str, namespace):
        self.rid = rid
        self.namespace = namespace
        self.tokens: List[int] = []
        self.row: Optional[int] = None
        self.kv_len = 0
        self.cache_protected_len = 0
        self.last_node = None
        # always sample at the end of the sequence; never asks for prompt logprobs
        self.output_ids = ()
        self.max_new_tokens = 1
        self.finished = False
        self.wants_input_logprobs = False
        self.logprob_start_len = -1

    @property
    def fill_ids(self) -> List[int]:
        return self.tokens

    @property
    def seq_len(self) -> int:
        return len(self.tokens)

    @property
    def prompt_len(self) -> int:
        return len(self.tokens)


def _common_prefix(a: List[int], b: List[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class StandaloneDraftSource(DraftSource):
    def __init__(self, spec, target_runner, server_args):
        from lmprog_runtime.cache.allocator import TokenSlotAllocator
        from lmprog_runtime.cache.manager import KVManager
        from lmprog_runtime.cache.radix import RadixCache
        from lmprog_runtime.model_executor.runner import ModelRunner

        draft_args = server_args.replace(
            model_path=spec.draft_model_path, tokenizer_path=None, speculative_algorithm=None,
            speculative_draft_model_path=None, speculative_num_steps=None, speculative_num_draft_tokens=None,
            max_total_tokens=server_args.max_total_tokens or target_runner.max_total_num_tokens,
            max_running_requests=target_runner.req_to_token_pool.size)
        self.runner = ModelRunner(draft_args)
        tv, dv = target_runner.model_config.vocab_size, self.runner.model_config.vocab_size
        if tv != dv:
            raise ValueError(f"speculative_draft_model_path: the draft model's vocabulary has {dv} tokens, "
                             f"the target's {tv}; STANDALONE needs the same tokenizer.")
        page = server_args.page_size
        allocator = TokenSlotAllocator(self.runner.max_total_num_tokens, page)
        tree = RadixCache(allocator, page_size=page, disable=server_args.disable_radix_cache)
        self.kv = KVManager(self.runner.req_to_token_pool, allocator, tree)
        self.max_len = self.runner.context_length - 1
        self.seqs: Dict[str, _DraftSeq] = {}

    # -- the contract -------------------------------------------------------------------------
    def propose(self, reqs: Sequence, budgets: Sequence[int], prefixes=None) -> List[Optional[Draft]]:
        drafts: List[List[int]] = [[] for _ in reqs]
        active = []
        for i, (r, k) in enumerate(zip(reqs, budgets)):
            if prefixes and prefixes[i]:  # no drafting after forced text here: the forced text stays alone
                continue
            s = self._sync(r)
            if s.seq_len + k <= self.max_len:
                active.append((i, s, k))
        while active:
            computed = self._forward([s for _, s, _ in active])
            nxt = []
            for i, s, k in active:
                tok = computed.get(id(s))
                if tok is None:
                    continue
                s.tokens.append(tok)
                drafts[i].append(tok)
                if len(drafts[i]) < k:
                    nxt.append((i, s, k))
            active = nxt
        return [Draft(d) if d else None for d in drafts]

    def release(self, req) -> None:
        s = self.seqs.pop(req.rid, None)
        if s is not None:
            self.kv.release(s, cache=True)  # its KV is the draft model's, for exactly s.tokens

    def check_integrity(self) -> None:
        self.kv.check_integrity(self.seqs.values())

    def flush(self) -> None:
        for s in list(self.seqs.values()):  # none when the scheduler is idle; to be safe
            self.kv.release(s, cache=False)
        self.seqs.clear()
        self.kv.flush()

    # -- internals ----------------------------------------------------------------------------
    def _sync(self, r) -> _DraftSeq:
        """The shadow of `r`, its tokens set to r's and its KV cut to their common prefix."""
        target = r.origin_input_ids + r.output_ids
        s = self.seqs.get(r.rid)
        if s is None:
            s = self.seqs[r.rid] = _DraftSeq(r.rid, r.namespace)
        if s.row is not None:
            # keep KV of the common prefix, and at least the last token to compute
            cut = min(s.kv_len, _common_prefix(s.tokens, target), len(target) - 1)
            if cut < s.cache_protected_len:
                self.kv.retract(s)  # the locked prefix itself changed: give everything back
            else:
                self.kv.truncate(s, cut)
        s.tokens = target
        return s

    def _forward(self, seqs: List[_DraftSeq]) -> Dict[int, int]:
        """One draft forward over every shadow's pending tokens → id(shadow) → next token."""
        from lmprog_runtime.scheduler.batch import StepPlan, build_forward_batch
        plan = StepPlan()
        for s in seqs:
            if s.row is None and not self.kv.assign(s):
                continue
            n = s.seq_len - s.kv_len
            loc = self.kv.alloc_extend(s, n) if n > 0 else None
            if loc is None:
                continue
            plan.add(s, n, loc)
        if plan.empty:
            return {}
        batch = build_forward_batch(plan, self.runner)
        try:
            logits = self.runner.forward(batch)
        except Exception:
            for item in plan.items:  # this forward's slots are the shadow's own: free them all
                self.kv.commit(item.req, item.num_tokens)
                self.kv.retract(item.req, cache=False)
            raise
        for item in plan.items:
            self.kv.commit(item.req, item.num_tokens)
        rows = [it.sample_row for it in plan.items]
        best = torch.argmax(logits[rows], dim=-1).tolist()
        return {id(it.req): t for it, t in zip(plan.items, best)}
