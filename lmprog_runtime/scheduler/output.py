"""After the forward: sample, score logprobs, advance grammars, jump forward, detect
stops, and hand deltas to the tokenizer manager."""

from __future__ import annotations

import logging
import re
import time
from typing import List, Optional

import numpy as np
import torch

from lmprog_runtime.messages import BatchOutput, ReqOutput

logger = logging.getLogger(__name__)

STATS_EVERY_STEPS = 8


class OutputProcessor:
    def __init__(self, scheduler):
        self.s = scheduler
        self.tokenizer = scheduler.tokenizer
        self.eos = set(scheduler.runner.model_config.eos_token_ids)
        self.send = None
        self.pending: List[ReqOutput] = []
        self._steps = 0
        self._mask_bufs: list = [None, None]  # reused mask rows, alternating between steps
        self._mask_views: dict = {}           # (buffer, rows, vocab) -> (numpy rows, torch rows)
        self._mask_flip = 0

    # -- the step's results -------------------------------------------------------------
    def grammar_masks(self, plan) -> Optional[torch.Tensor]:
        """Allowed-token masks of this step's sampled rows; needs only the grammar states
        after the previous step, so the overlap scheduler builds it during the forward."""
        reqs = [it.req for it in plan.items if it.sample_row >= 0]
        t0 = time.perf_counter()
        mask = self._grammar_mask(reqs, self.s.runner.model_config.vocab_size)
        if mask is not None:
            stats = self.s.stats
            stats["mask_s"] += time.perf_counter() - t0
            stats["mask_rows"] += sum(r.grammar is not None for r in reqs)
        return mask

    def process(self, plan, logits: torch.Tensor, mask: Optional[torch.Tensor] = None) -> None:
        s = self.s
        for item in plan.items:
            s.kv.commit(item.req, item.num_tokens)
        self._input_logprobs(plan, logits)
        sampled = [it for it in plan.items if it.sample_row >= 0]
        for item in plan.items:
            r = item.req
            if r.prompt_len <= r.kv_len and r.kv_len - item.num_tokens < r.prompt_len:
                s.kv.cache_unfinished(r)  # the prompt just finished computing: share it now
            if r.max_new_tokens == 0 and r.kv_len >= r.prompt_len:
                r.finish({"type": "length", "length": 0})
        if not sampled:
            return
        reqs = [it.req for it in sampled]
        rows = logits[[it.sample_row for it in sampled]]
        if mask is not None and mask.shape[-1] < rows.shape[-1]:  # padded vocab rows stay banned
            pad = torch.zeros((mask.shape[0], rows.shape[-1] - mask.shape[-1]), dtype=torch.bool)
            mask = torch.cat([mask, pad], dim=-1)
        need_lp = any(r.return_logprob for r in reqs)
        result = s.sampler(rows, reqs, mask, need_logprobs=need_lp)
        s.stats["num_generated_tokens"] += len(reqs)
        for i, r in enumerate(reqs):
            if r.finished:  # aborted during the step
                continue
            token = result.token_ids[i]
            r.output_ids.append(token)
            if r.return_logprob:
                self._output_logprobs(r, result.logprobs[i], token)
            self._advance_grammar(r, token)
            self._check_finished(r, token)
            if not r.finished and r.grammar is not None and not s.args.disable_jump_forward:
                self._jump_forward(r)
            self._maybe_stream(r)

    def _input_logprobs(self, plan, logits: torch.Tensor) -> None:
        for item in plan.items:
            r = item.req
            if not r.wants_input_logprobs:
                continue
            if r.logprob_start_len == 0 and not r.input_token_logprobs:
                # The first prompt token has no predecessor to score it.
                r.input_token_logprobs.append((None, r.origin_input_ids[0]))
                r.input_top_logprobs.append(None)
                r.input_token_ids_logprobs.append(None)
            if item.input_rows:
                lp = torch.log_softmax(logits[item.input_rows].float(), dim=-1)
                tokens = torch.tensor([r.origin_input_ids[j] for j in item.input_positions], device=lp.device)
                vals = lp.gather(1, tokens[:, None]).view(-1).tolist()
                r.input_token_logprobs.extend(zip(vals, tokens.tolist()))
                r.input_top_logprobs.extend(self._top(lp, r.top_logprobs_num))
                r.input_token_ids_logprobs.extend(self._by_ids(lp, r.token_ids_logprob))
            if r.kv_len >= r.prompt_len:
                r.input_logprobs_done = True

    @staticmethod
    def _top(lp: torch.Tensor, k: int) -> list:
        if k <= 0:
            return [[] for _ in range(lp.shape[0])]
        vals, idx = lp.topk(min(k, lp.shape[-1]), dim=-1)
        return [list(zip(v, i)) for v, i in zip(vals.tolist(), idx.tolist())]

    @staticmethod
    def _by_ids(lp: torch.Tensor, ids: Optional[list]) -> list:
        if not ids:
            return [[] for _ in range(lp.shape[0])]
        vals = lp[:, ids].tolist()
        return [list(zip(v, ids)) for v in vals]

    def _output_logprobs(self, r, lp_row: torch.Tensor, token: int) -> None:
        lp_row = lp_row[None, :]
        r.output_token_logprobs.append((float(lp_row[0, token]), token))
        if r.top_logprobs_num > 0:
            r.output_top_logprobs.append(self._top(lp_row, r.top_logprobs_num)[0])
        if r.token_ids_logprob:
            r.output_token_ids_logprobs.append(self._by_ids(lp_row, r.token_ids_logprob)[0])

    # -- grammar --------------------------------------------------------------------------
    def _grammar_mask(self, reqs: list, vocab: int) -> Optional[torch.Tensor]:
        if not any(r.grammar is not None for r in reqs):
            return None
        rows, mask = self._mask_buffer(len(reqs), vocab)  # numpy: torch fills of this size
        for i, r in enumerate(reqs):                      # fan out to the intra-op pool
            g = r.grammar
            if g is not None and not g.is_terminated():
                g.write_mask(rows[i])
            else:
                rows[i].fill(True)
        return mask

    def _mask_buffer(self, n: int, vocab: int):
        """([n, vocab] numpy rows, the same memory as a torch tensor) from a buffer reused
        every other step. At batch 1 this step runs with caches just emptied by the
        forward, where a fresh 49k-wide allocation cost ~150 us and even torch.from_numpy
        ~20 us, so the views are cached too. Two buffers let the overlap scheduler build
        step N+1's mask while step N's is still being read."""
        flip = self._mask_flip
        self._mask_flip ^= 1
        hit = self._mask_views.get((flip, n, vocab))
        if hit is not None:
            return hit
        buf = self._mask_bufs[flip]
        if buf is None or buf.shape[0] < n or buf.shape[1] != vocab:
            buf = np.empty((max(n, 2 * (0 if buf is None else buf.shape[0]), 8), vocab), dtype=np.bool_)
            self._mask_bufs[flip] = buf
            self._mask_views = {k: v for k, v in self._mask_views.items() if k[0] != flip}
        rows = buf[:n]
        self._mask_views[(flip, n, vocab)] = hit = (rows, torch.from_numpy(rows))
        return hit

    def _advance_grammar(self, r, token: int) -> None:
        if r.grammar is None:
            return
        try:
            r.grammar.accept_token(token)
        except Exception as e:
            r.finish({"type": "abort", "status_code": 500, "err_type": None,
                      "message": f"grammar rejected token {token}: {e}"})

    def _jump_forward(self, r) -> None:
        from lmprog_runtime.constrained.jump_forward import jump_forward_retokenize
        jump = r.grammar.jump_forward_str()
        if not jump:
            return
        keep, new_ids = jump_forward_retokenize(self.tokenizer, r.output_ids, jump,
                                                r.origin_input_ids[-5:])
        if not new_ids and keep == len(r.output_ids):
            return
        old = r.output_ids
        r.grammar.jump_and_retokenize(old, new_ids, keep)
        r.output_ids = old[:keep] + new_ids
        self.s.stats["num_jump_forward_tokens"] += len(new_ids)
        r.first_changed = min(r.first_changed, keep)
        # KV computed for rewritten tokens is stale: drop it; the next step extends again.
        self.s.kv.truncate(r, r.prompt_len + keep)
        if r.return_logprob:  # forced tokens carry no sampled logprob; keep lists aligned
            del r.output_token_logprobs[keep:]
            r.output_token_logprobs.extend((0.0, t) for t in new_ids)
            if r.top_logprobs_num > 0:
                del r.output_top_logprobs[keep:]
                r.output_top_logprobs.extend([] for _ in new_ids)
            if r.token_ids_logprob:
                del r.output_token_ids_logprobs[keep:]
                r.output_token_ids_logprobs.extend([] for _ in new_ids)
            r.logprobs_sent = min(r.logprobs_sent, keep)
        if r.grammar.is_terminated():
            r.finish({"type": "stop", "matched": None})
        elif len(r.output_ids) >= r.max_new_tokens:
            r.finish({"type": "length", "length": r.max_new_tokens})

    # -- stops ----------------------------------------------------------------------------
    def _check_finished(self, r, token: int) -> None:
        sp = r.sampling
        if r.finished:
            return
        if len(r.output_ids) >= sp.min_new_tokens:
            if sp.stop_strs:
                window = r.output_ids[-(sp.stop_str_max_len + 2):]
                tail = self.tokenizer.decode(window, skip_special_tokens=sp.skip_special_tokens)
                for stop in sp.stop_strs:
                    if stop in tail:
                        return r.finish({"type": "stop", "matched": stop})
            if sp.stop_regex_strs:
                text = self.tokenizer.decode(r.output_ids, skip_special_tokens=sp.skip_special_tokens)
                for pattern in sp.stop_regex_strs:
                    if re.search(pattern, text):
                        return r.finish({"type": "stop", "matched": pattern})
            if sp.stop_token_ids and token in sp.stop_token_ids:
                return r.finish({"type": "stop", "matched": token})
            if token in self.eos and not sp.ignore_eos:
                return r.finish({"type": "stop", "matched": token})
        if len(r.output_ids) >= sp.max_new_tokens:
            return r.finish({"type": "length", "length": sp.max_new_tokens})
        if r.grammar is not None and r.grammar.is_terminated():
            # The grammar is complete without an EOS: the last token is content, not a stop token.
            return r.finish({"type": "stop", "matched": None})

    # -- sending --------------------------------------------------------------------------
    def _maybe_stream(self, r) -> None:
        if r.finished or not r.stream:
            return
        interval = r.sampling.stream_interval or self.s.args.stream_interval
        n = len(r.output_ids)
        if interval == 1 or n % interval == 1:
            self.pending.append(self._delta(r))

    def send_final(self, r) -> None:
        self.pending.append(self._delta(r))

    def reject(self, r, message: str, status_code: int = 400) -> None:
        r.finish({"type": "abort", "message": message, "status_code": status_code, "err_type": "BadRequest"})
        self.send_final(r)

    def _delta(self, r) -> ReqOutput:
        start = min(r.sent_output_len, r.first_changed)
        out = ReqOutput(
            rid=r.rid, output_offset=start, output_ids=r.output_ids[start:],
            finished_reason=r.finished_reason, prompt_tokens=r.prompt_len,
            completion_tokens=len(r.output_ids), cached_tokens=r.cached_tokens,
            num_retractions=r.num_retractions)
        r.sent_output_len = r.first_changed = len(r.output_ids)
        if r.return_logprob:
            k = r.logprobs_sent
            out.output_token_logprobs = r.output_token_logprobs[k:]
            out.output_top_logprobs = r.output_top_logprobs[k:]
            out.output_token_ids_logprobs = r.output_token_ids_logprobs[k:]
            out.logprob_offset = k
            r.logprobs_sent = len(r.output_token_logprobs)
            if not r.input_logprobs_sent and (r.input_logprobs_done or r.finished):
                out.input_token_logprobs = r.input_token_logprobs
                out.input_top_logprobs = r.input_top_logprobs
                out.input_token_ids_logprobs = r.input_token_ids_logprobs
                r.input_logprobs_sent = True
        return out

    def flush(self) -> None:
        self._steps += 1
        stats = None
        if self._steps % STATS_EVERY_STEPS == 0 or (self.pending and self.s.is_idle()):
            stats = self.s.internal_state()
        if self.pending or stats is not None:
            self.send(BatchOutput(self.pending, stats))
            self.pending = []
