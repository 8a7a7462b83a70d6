"""Sampler: SGLang's logit pipeline for a batch of requests, one row each.

Order per step: additive penalties (frequency, presence; counts over generated
tokens) → min_new_tokens (stop tokens banned) → repetition penalty → grammar mask
→ logit_bias → temperature → top-k / top-p / min-p → sample (argmax when greedy).
Returned logprobs are log_softmax(logits / temperature) after penalties, mask and
bias, before truncation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import numpy as np
import torch

from lmprog_runtime.constrained.bitmask import fit_words, unpack_rows
from lmprog_runtime.sampling_params import TOP_K_ALL


@dataclass
class SampleResult:
    token_ids: List[int]
    logprobs: torch.Tensor  # [B, V] float32 log-probabilities (only valid rows that asked), or empty


class Sampler:
    def __init__(self, vocab_size: int, eos_token_ids: Sequence[int], seed: int = 0):
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, reqs: list, grammar_mask: Optional[torch.Tensor] = None,
                 need_logprobs: bool = False) -> SampleResult:
        """logits [B, V] float32 (modified in place); grammar_mask [B, V'] bool (True = allowed)
        or an int32 bitmask [B, W] (bit j of word w = token 32w + j allowed: MaskBuilder's)."""
        scaled = self.scaled_logits(logits, reqs, grammar_mask)
        logprobs = torch.log_softmax(scaled, dim=-1) if need_logprobs else torch.empty(0)

        token_ids = [0] * len(reqs)
        greedy_rows = [i for i, r in enumerate(reqs) if r.sampling.is_greedy]
        sample_rows = [i for i, r in enumerate(reqs) if not r.sampling.is_greedy]
        if greedy_rows:
            picked = torch.argmax(scaled[greedy_rows], dim=-1).tolist()
            for i, t in zip(greedy_rows, picked):
                token_ids[i] = t
        if sample_rows:
            probs = self.truncated_probs(scaled[sample_rows], [reqs[i] for i in sample_rows])
            probs = probs.cpu()  # the generators are CPU ones: same seed, same draws on any device
            unseeded = [k for k, i in enumerate(sample_rows) if reqs[i].generator is None]
            if unseeded:
                drawn = torch.multinomial(probs[unseeded], 1, generator=self.generator).view(-1).tolist()
                for k, t in zip(unseeded, drawn):
                    token_ids[sample_rows[k]] = t
            for k, i in enumerate(sample_rows):
                if reqs[i].generator is not None:
                    token_ids[i] = int(torch.multinomial(probs[k], 1, generator=reqs[i].generator))
        return SampleResult(token_ids, logprobs)

    def plain_argmax(self, logits: torch.Tensor, rows: List[int], reqs: list,
                     grammar_mask: Optional[torch.Tensor] = None) -> Optional[List[int]]:
        """The tokens of rows `rows` of logits [N, V] for `reqs` (one each) when every request
        is greedy and nothing but a grammar mask edits its logits (no penalty, stop-token ban or
        bias; the caller wants no logprobs): their argmax, read in place, the token `__call__`
        picks (the same first index of the maximum). `grammar_mask` [len(rows), V'] bool (True =
        allowed, columns past V' banned) or int32 bitmask [len(rows), W] as `__call__` takes
        it: the maximum over the allowed columns (a bitmask row is unpacked only where its
        favourite is banned). None where that does not hold or the logits are not float32 on the CPU.
        numpy runs on the calling thread; torch's row copy, mask fill, divide and argmax are each
        a parallel region, whose wake-up and join took ~15% of a batch-1 decode step on two
        cores (and a 9-row masked verify's pipeline ~1 ms)."""
        if logits.device.type != "cpu" or logits.dtype != torch.float32 or not all(map(self._untouched, reqs)):
            return None
        lg = logits.numpy()
        if grammar_mask is None:  # row by row on views: the fancy-indexed [rows, V] copy took 16-300 us at 1-8 rows
            return [int(np.argmax(lg[row, : self.vocab_size])) for row in rows]
        packed = grammar_mask.dtype == torch.int32
        width = min(grammar_mask.shape[-1] * 32, self.vocab_size) if packed else grammar_mask.shape[-1]
        if (grammar_mask.device.type != "cpu" or not (packed or grammar_mask.dtype == torch.bool)
                or width > self.vocab_size or grammar_mask.shape[0] != len(rows)):
            return None
        # A row's first maximum over all columns, when its mask allows it, is also the first
        # maximum over the allowed ones (nothing before it reaches that value): the usual case,
        # one argmax of a view. Only a row whose favourite is banned pays for the masked copy.
        mk, out = grammar_mask.numpy(), []
        for i, row in enumerate(rows):
            t = int(np.argmax(lg[row, :width]))
            ok = (mk[i, t >> 5] >> (t & 31)) & 1 if packed else mk[i, t]
            if not ok:
                allowed = unpack_rows(mk[i:i + 1], width)[0] if packed else mk[i]
                t = int(np.argmax(np.where(allowed, lg[row, :width], -np.inf)))
            out.append(t)
        return out

    def _untouched(self, r) -> bool:
        """Greedy and nothing of the pipeline before the draw changes its row."""
        sp = r.sampling
        if not sp.is_greedy or sp.logit_bias:
            return False
        if len(r.output_ids) < sp.min_new_tokens and (sp.stop_token_ids or not sp.ignore_eos and self.eos_token_ids):
            return False
        return not (r.output_ids and (sp.frequency_penalty or sp.presence_penalty or sp.repetition_penalty != 1.0))

    def scaled_logits(self, logits: torch.Tensor, reqs: list,
                      grammar_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The pipeline up to the draw: penalties, mask, bias, temperature → [B, V] (what
        greedy takes the argmax of and the returned logprobs are the log_softmax of).
        `logits` is modified in place."""
        logits = logits[:, : self.vocab_size]
        self._apply_penalties(logits, reqs)
        if grammar_mask is not None:
            self._apply_grammar_mask(logits, grammar_mask)
        self._apply_logit_bias(logits, reqs)
        temps = torch.tensor([1.0 if r.sampling.is_greedy else r.sampling.temperature for r in reqs],
                             dtype=logits.dtype, device=logits.device)
        return logits / temps[:, None]

    # -- pipeline stages ------------------------------------------------------------------
    def _apply_penalties(self, logits: torch.Tensor, reqs: list) -> None:
        for i, r in enumerate(reqs):
            sp = r.sampling
            if len(r.output_ids) < sp.min_new_tokens:
                banned = list(sp.stop_token_ids or [])
                if not sp.ignore_eos:
                    banned += self.eos_token_ids
                if banned:
                    logits[i, banned] = float("-inf")
            if not r.output_ids or (sp.frequency_penalty == 0 and sp.presence_penalty == 0
                                    and sp.repetition_penalty == 1.0):
                continue
            counts = torch.bincount(torch.tensor(r.output_ids, device=logits.device),
                                    minlength=self.vocab_size)[: self.vocab_size]
            counts = counts.to(logits.dtype)
            row = logits[i]
            if sp.frequency_penalty:
                row -= sp.frequency_penalty * counts
            if sp.presence_penalty:
                row -= sp.presence_penalty * (counts > 0).to(logits.dtype)
            if sp.repetition_penalty != 1.0:
                seen = counts > 0
                pen = torch.where(row > 0, row / sp.repetition_penalty, row * sp.repetition_penalty)
                row.copy_(torch.where(seen, pen, row))

    @staticmethod
    def _apply_grammar_mask(logits: torch.Tensor, mask: torch.Tensor) -> None:
        """mask [B, V'] bool, True = allowed, or an int32 bitmask [B, W]; logits columns past V'
        (32W: a vocabulary padded past its tokens) are banned. On CUDA a bitmask is applied as
        it is by a Triton kernel (`bitmask_kernel.py`; a bool mask is packed first, 32x smaller
        to copy); on the CPU a bitmask is unpacked (one numpy call for the batch)."""
        V = logits.shape[-1]
        if mask.dtype == torch.int32:
            if logits.is_cuda:
                from lmprog_runtime.constrained.bitmask_kernel import apply_token_bitmask_

                apply_token_bitmask_(logits, fit_words(mask, V).to(logits.device, non_blocking=True))
                return
            mask = torch.from_numpy(unpack_rows(mask.numpy(), V))
        if mask.shape[-1] < logits.shape[-1]:
            pad = torch.zeros((mask.shape[0], logits.shape[-1] - mask.shape[-1]), dtype=torch.bool)
            mask = torch.cat([mask, pad], dim=-1)
        if logits.is_cuda:
            from lmprog_runtime.constrained.bitmask_kernel import apply_token_bitmask_, pack_token_bitmask

            bitmask = pack_token_bitmask(mask.cpu()).to(logits.device, non_blocking=True)
            apply_token_bitmask_(logits, bitmask)
        else:
            logits.masked_fill_(~mask, float("-inf"))

    @staticmethod
    def _apply_logit_bias(logits: torch.Tensor, reqs: list) -> None:
        for i, r in enumerate(reqs):
            if r.sampling.logit_bias:
                for token, bias in r.sampling.logit_bias.items():
                    logits[i, int(token)] += float(bias)

    @staticmethod
    def truncated_probs(scaled: torch.Tensor, reqs: list) -> torch.Tensor:
        """Softmax with per-row top-k, top-p and min-p applied; [b, V]."""
        probs = torch.softmax(scaled, dim=-1)
        top_ks = [r.sampling.top_k for r in reqs]
        top_ps = [r.sampling.top_p for r in reqs]
        min_ps = [r.sampling.min_p for r in reqs]
        if all(k >= TOP_K_ALL for k in top_ks) and all(p >= 1.0 for p in top_ps) and not any(min_ps):
            return probs
        sorted_probs, sorted_idx = torch.sort(probs, dim=-1, descending=True)
        vocab = probs.shape[-1]
        dev = probs.device
        ranks = torch.arange(vocab, device=dev)[None, :]
        k = torch.tensor([min(k, vocab) for k in top_ks], device=dev)[:, None]
        drop = ranks >= k
        cum = torch.cumsum(sorted_probs, dim=-1)
        drop |= (cum - sorted_probs) > torch.tensor(top_ps, dtype=probs.dtype, device=dev)[:, None]
        drop |= sorted_probs < sorted_probs[:, :1] * torch.tensor(min_ps, dtype=probs.dtype, device=dev)[:, None]
        drop[:, 0] = False  # the most likely token always survives
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        out = torch.zeros_like(probs).scatter_(-1, sorted_idx, sorted_probs)
        return out / out.sum(dim=-1, keepdim=True)
