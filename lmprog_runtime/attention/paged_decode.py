"""Paged decode attention for the CPU: each request's K/V read in place from the token pool.

`paged_decode(q, k_cache, v_cache, table, rows, seq_lens, scale, prefix)` -> [B, H, D]: one
query token per request against its first `seq_lens[b]` slots `table[rows[b], :]`, no gather;
with `prefix` (slots [P] that every request's first P positions share, cascade) those keys are
read once for the whole batch. The work is split by chunk of prefix keys and (request, chunk
of own keys), every kv head in one task (each tile's whole K/V rows touched in order first), or
per kv head too where chunks are fewer than threads, across threads (a help-first worker pool in
paged_decode.c), so one long context also uses every thread (chunks merged exactly); small
calls (short contexts, few requests) run on the calling thread (SERIAL_WORK). The kernel is
paged_decode.c, compiled by `native.build`
into the cache directory at first use (keyed by source, flags and CPU);
`available()` is False where that is impossible and callers keep the gather path.
Query float32, K/V float32 or bfloat16 (widened exactly, float32 math); torch_native is the
oracle (tests/runtime/test_paged_decode.py).
"""

from __future__ import annotations

import ctypes
import pathlib
from typing import Optional

import torch

from lmprog_runtime import native

_SOURCE = pathlib.Path(__file__).with_name("paged_decode.c")
KV_DTYPES = (torch.float32, torch.bfloat16)  # K/V the kernel reads (the query is float32)
MAX_D = 512  # head_dim limit (paged_decode.c)
CHUNK = 256  # keys per task: long contexts split into this many-key pieces across threads (a
# fixed grid of positions, so a verify row and a decode at its position read the same chunks)
enabled = True  # tests switch the kernel off to compare against the gather path


def _declare(lib: ctypes.CDLL) -> None:
    p, i32, i64, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    lib.lm_paged_decode.argtypes = [p, p, p, i32, p, i64, p, i64, p, p, i32, i32, i32, i32, f32, i64, i32, p, p]
    lib.lm_paged_decode.restype = None
    if not hasattr(lib, "lm_paged_decode_use_pool"):  # an older build (bench/ab_paged_decode.py's)
        return
    lib.lm_paged_decode_use_pool.argtypes = [p]
    lib.lm_paged_decode_use_pool.restype = None
    lib.lm_paged_decode_shares_pool.argtypes, lib.lm_paged_decode_shares_pool.restype = [], ctypes.c_int
    _share_pool(lib)


def _share_pool(lib: ctypes.CDLL) -> None:
    """Run the kernel's parallel calls on qdot.c's worker pool where that library builds: a
    step's matmuls and attention then share one set of worker threads, instead of two sets
    taking the cores from each other while each waits for its next job."""
    from lmprog_runtime.model_executor import qgemm  # here, not at import: no import cycle

    dot = qgemm.dot_library()
    if dot is not None:
        lib.lm_paged_decode_use_pool(ctypes.cast(dot.lm_pool_run, ctypes.c_void_p).value)


_KERNEL = native.Kernel(_SOURCE, native.NATIVE_FLAGS, True, _declare)


def available() -> bool:
    """False where the kernel cannot be built (no C compiler): callers gather K/V instead."""
    return enabled and _KERNEL.lib() is not None


def kernel_fn():
    """lm_paged_decode itself (PagedDecodePlan.c_args gives its arguments)."""
    return _KERNEL.lib().lm_paged_decode


class PagedDecodePlan:
    """What every layer of one decode step shares, prepared once per step (`init_forward_metadata`):
    the contiguous index tensors, the scratch buffer, the shapes. `run(q, k_cache, v_cache)` per
    layer is then one C call (a few small torch ops per layer less than `paged_decode`).

    table int64 [R, L] contiguous; rows, seq_lens int64 [B]; prefix int64 [P] (every seq_len > P)
    or None; max_seq_len = max(seq_lens) if the caller knows it; heads, kv_heads, head_dim the
    model's; kv_bf16 whether K/V are bfloat16 (else float32)."""

    def __init__(self, table: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                 heads: int, kv_heads: int, head_dim: int, kv_bf16: bool,
                 prefix: Optional[torch.Tensor] = None, max_seq_len: Optional[int] = None):
        assert available() and head_dim <= MAX_D and table.is_contiguous() and heads % kv_heads == 0
        self.table, self.rows, self.seq_lens = table, rows.contiguous(), seq_lens.contiguous()
        self.B, self.H, self.KV, self.D = self.rows.numel(), heads, kv_heads, head_dim
        self.scale, self.kv_bf16 = scale, kv_bf16
        self.P = 0 if prefix is None else prefix.numel()
        # any valid pointer when P = 0
        self.prefix = table if prefix is None else prefix.to(torch.int64).contiguous()
        pre_chunks = (self.P + CHUNK - 1) // CHUNK
        longest = max_seq_len or int(self.seq_lens.max())
        own_chunks = max(0 if self.P else 1, (longest - self.P + CHUNK - 1) // CHUNK)
        self.scratch = torch.empty(self.B * kv_heads * (pre_chunks + own_chunks) * (heads // kv_heads)
                                   * (head_dim + 2), dtype=torch.float32)

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """q float32 [B, H, D] contiguous; k_cache, v_cache [slots, KV, D] contiguous -> [B, H, D]."""
        assert q.dtype == torch.float32 and q.is_contiguous() and q.shape == (self.B, self.H, self.D)
        assert k_cache.dtype == v_cache.dtype == (torch.bfloat16 if self.kv_bf16 else torch.float32)
        assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape[1] == self.KV
        out = torch.empty_like(q)
        _KERNEL.lib().lm_paged_decode(*self.c_args(q, k_cache, v_cache, out))
        return out

    def c_args(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor) -> tuple:
        """lm_paged_decode's arguments for this plan (bench/ab_paged_decode.py calls other builds with them)."""
        return (q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), int(self.kv_bf16), self.prefix.data_ptr(),
                self.P, self.table.data_ptr(), self.table.stride(0), self.rows.data_ptr(), self.seq_lens.data_ptr(),
                self.B, self.H, self.KV, self.D, self.scale, CHUNK, torch.get_num_threads(), self.scratch.data_ptr(),
                out.data_ptr())


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                 rows: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                 prefix: Optional[torch.Tensor] = None, max_seq_len: Optional[int] = None) -> torch.Tensor:
    """q [B, H, D]; k_cache, v_cache [slots, KV, D]; table int64 [R, L]; rows, seq_lens int64 [B];
    prefix int64 [P] (every seq_len > P) or None; max_seq_len = max(seq_lens) if the caller knows it."""
    assert available() and q.dtype == torch.float32 and k_cache.dtype == v_cache.dtype in KV_DTYPES
    B, H, D = q.shape
    plan = PagedDecodePlan(table, rows, seq_lens, scale, H, k_cache.shape[1], D, k_cache.dtype == torch.bfloat16,
                           prefix, max_seq_len)
    return plan.run(q.contiguous(), k_cache, v_cache)
