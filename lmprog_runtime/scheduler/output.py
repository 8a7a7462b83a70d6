"""Post-processing of one step, after the forward:

    commit the computed KV → score prompt logprobs → share finished prompts with the
    cache → sample → per request: append the token, its logprob, advance the grammar,
    check stops, queue a streamed delta → verify the drafts (speculative and forced text,
    jump_forward.py) and append what the model accepted the same way.

Each sampled request goes through `on_token` alone: an exception there finishes only that
request, with an error naming the stage it was in (faults.py). A failure of the batched
sampler is retried row by row, so only the request that fails it fails. KV moves only
through `kv` (a KVManager).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

from lmprog_runtime.messages import FinishReason
from lmprog_runtime.scheduler.faults import Stage, fail_request
from lmprog_runtime.scheduler.logprobs import record_input_logprobs, record_output_logprob
from lmprog_runtime.speculative.tree import depths

logger = logging.getLogger(__name__)


@dataclass
class Sampled:
    """The sampler's decision for this step's sampled rows."""

    reqs: List
    token_ids: List[Optional[int]]  # None: that request failed in sampling (and is finished)
    logprobs: Optional[Sequence[torch.Tensor]]  # float [len(reqs), vocab] rows, when a request asked


class PostProcessor:
    def __init__(self, kv, sampler, stops, jump, outbox, stats: dict, faults=None):
        self.faults = faults    # FaultInjector (tests only) or None
        self.kv = kv
        self.sampler = sampler
        self.stops = stops      # StopChecker
        self.jump = jump        # jump_forward.JumpForward (accounts forced drafts); None: disabled
        self.outbox = outbox    # streamed deltas go here
        self.stats = stats      # adds num_generated_tokens
        self.speculator = None  # speculative/speculator.py's Speculator, set when speculation is on

    def process(self, plan, logits: torch.Tensor, mask: Optional[torch.Tensor]) -> None:
        for item in plan.items:
            self.kv.commit(item.req, item.num_tokens)
        record_input_logprobs(plan, logits)
        for item in plan.items:
            self._after_compute(item.req, item.num_tokens)
        sampled = self.sample(plan, logits, mask)
        if sampled is not None:
            for i, r in enumerate(sampled.reqs):
                if r.finished:  # aborted during the step
                    continue
                lp = sampled.logprobs[i] if r.return_logprob else None  # r.finished covers failed sampling
                self.on_token(r, sampled.token_ids[i], lp)
        verified = plan.verified_items()
        if verified:
            self.verify(verified, logits)

    def verify(self, items, logits: torch.Tensor) -> None:
        """Speculative decoding: accept a prefix of each request's draft plus a bonus token
        (verify.py), append them through `on_token`, and free the KV of the rejected
        drafts at once (of a draft tree: the accepted path's KV is first moved in order
        after the root). A request's KV then covers its tokens but the last, as after any
        step; the tree never sees a draft (only `release` / `cache_unfinished` insert, and
        they read kv_len, which covers verified tokens only)."""
        from lmprog_runtime.speculative.verify import verify_rows
        for item in items:
            r, k = item.req, item.num_draft
            try:
                if not r.finished:
                    self._check(Stage.SAMPLING, r)
                    rows = logits[item.verify_row:item.verify_row + k + 1]  # (verify_rows copies it to edit)
                    v = verify_rows(self.sampler, r, rows, item.draft.tokens, item.draft.mask, item.draft.parents)
                    if v.path:  # a tree: the accepted nodes' KV moves to the positions after the root
                        self.kv.keep_path(r, item.start + item.num_tokens - k, v.path)
                    self.stats["num_generated_tokens"] += len(v.tokens)
                    self.on_run(r, v.tokens, v.logprobs)
                    self._account(r, item.draft, v)
            except Exception as e:
                fail_request(r, Stage.SAMPLING, e)
            finally:
                self.kv.truncate(r, min(r.kv_len, r.seq_len - 1))

    def _account(self, r, draft, v) -> None:
        """Counters: forced text to jump-forward's, the rest to the speculator's."""
        k = len(draft.tokens)
        nf = k if draft.forced else draft.num_forced
        if nf:
            self.jump.after_verify(nf, min(v.accepted, nf))
        if draft.forced:
            return
        reach = None if draft.parents is None else max(depths(draft.parents)) - nf
        moved = bool(v.path) and v.path[-1] != len(v.path) - 1
        self.speculator.after_verify(r, k - nf, max(0, v.accepted - nf), v.tokens, reach, moved)

    def on_run(self, r, tokens: List[int], lps: Optional[torch.Tensor]) -> None:
        """Several tokens in one step: each through `on_token`, up to the one that finishes
        the request; the streamed delta only after the last."""
        for i, t in enumerate(tokens):
            last = i == len(tokens) - 1
            self.on_token(r, t, None if lps is None else lps[i], last=last)
            if r.finished:
                return

    def _after_compute(self, r, num_tokens: int) -> None:
        if r.prompt_len <= r.kv_len and r.kv_len - num_tokens < r.prompt_len:
            self.kv.cache_unfinished(r)  # the prompt just finished computing: share it now
        if r.max_new_tokens == 0 and r.kv_len >= r.prompt_len:
            r.finish(FinishReason.length(0))

    def sample(self, plan, logits: torch.Tensor, mask: Optional[torch.Tensor]) -> Optional[Sampled]:
        items = [it for it in plan.items if it.sample_row >= 0]
        if not items:
            return None
        reqs = [it.req for it in items]
        picked = [it.sample_row for it in items]
        need_lp = any(r.return_logprob for r in reqs)
        try:
            if self.faults is not None:
                self.faults.check_any(Stage.SAMPLING, [r.rid for r in reqs], spend=False)
            plain = None if need_lp else self.sampler.plain_argmax(logits, picked, reqs, mask)
            if plain is not None:
                sampled = Sampled(reqs, plain, None)
            else:  # the rows copied: the sampler edits them in place
                result = self.sampler(logits[picked], reqs, mask, need_logprobs=need_lp)
                sampled = Sampled(reqs, result.token_ids, result.logprobs)
        except Exception:
            sampled = self._sample_alone(logits[picked], reqs, mask, need_lp)
        self.stats["num_generated_tokens"] += sum(t is not None for t in sampled.token_ids)
        return sampled

    def _sample_alone(self, rows: torch.Tensor, reqs: List, mask, need_lp: bool) -> Sampled:
        """The batched sampler failed: sample each request alone; those that fail finish."""
        tokens, lps = [], []
        for i, r in enumerate(reqs):
            try:
                if self.faults is not None:
                    self.faults.check(Stage.SAMPLING, r.rid)
                one = self.sampler(rows[i:i + 1], [r], None if mask is None else mask[i:i + 1],
                                   need_logprobs=need_lp)
                tokens.append(one.token_ids[0])
                lps.append(one.logprobs[0] if need_lp else None)
            except Exception as e:
                fail_request(r, Stage.SAMPLING, e)
                tokens.append(None)
                lps.append(None)
        return Sampled(reqs, tokens, lps if need_lp else None)

    def on_token(self, r, token: int, lp_row: Optional[torch.Tensor], last: bool = True) -> None:
        """Everything one sampled token does to its request; an exception at any stage
        finishes this request alone (its KV freed on release, not cached). `last` False:
        more tokens of a verified run follow in this step (no delta yet)."""
        stage = Stage.SAMPLING  # appending the token and its logprob
        try:
            r.output_ids.append(token)
            if lp_row is not None:
                record_output_logprob(r, lp_row, token)
            if r.grammar is not None:
                stage = Stage.GRAMMAR
                self._check(stage, r)
                r.grammar.accept_token(token)
            if not r.finished:
                stage = Stage.STOP_CHECK
                self._check(stage, r)
                reason = self.stops.check(r, token)
                if reason is not None:
                    r.finish(reason)
            stage = Stage.OUTPUT
            if last:
                self.outbox.stream(r)
        except Exception as e:
            fail_request(r, stage, e)

    def _check(self, stage: Stage, r) -> None:
        if self.faults is not None:
            self.faults.check(stage, r.rid)
