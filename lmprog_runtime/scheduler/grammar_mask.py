"""Allowed-token masks for the sampled rows of a step, from the requests' grammar states.

`build(reqs)` needs only the grammar states after the previous step, so the overlap
loop builds it while the forward runs. The mask is SGLang's bitmask (int32
[B, ceil(V / 32)], bit j of word w = token 32w + j allowed; `Grammar.write_bitmask`), 8x
smaller to write than bool rows, what xgrammar and llguidance fill natively and the CUDA
kernel reads as it is. Rows of requests without a grammar (or whose grammar has
terminated) allow everything. A grammar that fails to write its mask fails its own
request (faults.Stage.GRAMMAR_MASK, a 500; the row allows everything, and the request,
now finished, is not sampled). A mask that allows no token (a dead end: a constraint
no output satisfies, such as `{"const": true, "not": {"const": true}}`, or cfg's semantic
checks refusing every continuation of a prefix), which would otherwise be sampled from all
-inf logits, fails its request with a 400: the constraint's doing, not the server's.
"""

from __future__ import annotations

import time
from typing import Optional

import numpy as np
import torch

from lmprog_runtime.messages import FinishReason
from lmprog_runtime.scheduler.faults import Stage, fail_request

DEAD_END = "no token can continue the output under its constraint"


class MaskBuilder:
    def __init__(self, vocab_size: int, stats: dict, faults=None):
        self.faults = faults  # FaultInjector (tests only) or None
        self.vocab_size = vocab_size
        self.words = -(-vocab_size // 32)  # int32 words per bitmask row
        # the last word's bits of tokens past vocab_size, cleared after a backend wrote them
        # (xgrammar may set them), so that a dead end reads as no bit set
        self._tail = np.int32((1 << (vocab_size % 32)) - 1) if vocab_size % 32 else None
        self.stats = stats  # adds mask_s (wall seconds) and mask_rows (constrained rows)
        self._bufs: list = [None, None]  # reused mask rows, alternating between steps
        self._views: dict = {}           # (buffer, rows, vocab) -> (numpy rows, torch rows)
        self._flip = 0

    def build(self, reqs: list) -> Optional[torch.Tensor]:
        """int32 [len(reqs), ceil(vocab_size / 32)] bitmask (bit set = allowed), or None when
        no request is constrained."""
        if not any(r.grammar is not None for r in reqs):
            return None
        t0 = time.perf_counter()
        rows, mask = self._buffer(len(reqs), self.words)  # numpy: torch fills of this size
        for i, r in enumerate(reqs):                       # fan out to the intra-op pool
            g = r.grammar
            if g is not None and not g.is_terminated() and not r.finished:
                self._write(r, rows[i])
            else:
                rows[i].fill(-1)
        self.stats["mask_s"] += time.perf_counter() - t0
        self.stats["mask_rows"] += sum(r.grammar is not None for r in reqs)
        return mask

    def _write(self, r, row: np.ndarray) -> None:
        try:
            if self.faults is not None:
                self.faults.check(Stage.GRAMMAR_MASK, r.rid)
            r.grammar.write_bitmask(row)
            if self._tail is not None:
                row[-1] &= self._tail
        except Exception as e:
            fail_request(r, Stage.GRAMMAR_MASK, e)
            row.fill(-1)
            return
        if not row.any():  # a dead end: never sample it
            r.finish(FinishReason.error(400, f"{DEAD_END} (no output it accepts continues "
                                             f"{len(r.output_ids)} generated tokens)", "invalid_request_error"))
            row.fill(-1)

    def _buffer(self, n: int, words: int):
        """([n, words] int32 numpy rows, the same memory as a torch tensor) from a buffer
        reused every other step. At batch 1 this step runs with caches just emptied by the
        forward, where a fresh allocation and even torch.from_numpy (~20 us) cost more than a
        cached mask, so the views are cached too. Two buffers let the overlap scheduler build
        step N+1's mask while step N's is still being read."""
        flip = self._flip
        self._flip ^= 1
        hit = self._views.get((flip, n, words))
        if hit is not None:
            return hit
        buf = self._bufs[flip]
        if buf is None or buf.shape[0] < n or buf.shape[1] != words:
            buf = np.empty((max(n, 2 * (0 if buf is None else buf.shape[0]), 8), words), dtype=np.int32)
            self._bufs[flip] = buf
            self._views = {k: v for k, v in self._views.items() if k[0] != flip}
        rows = buf[:n]
        self._views[(flip, n, words)] = hit = (rows, torch.from_numpy(rows))
        return hit
