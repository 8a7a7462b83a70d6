"""Paged decode attention for the CPU: each request's K/V read in place from the token pool.

`paged_decode(q, k_cache, v_cache, table, rows, seq_lens, scale, prefix)` -> [B, H, D]: one
query token per request against its first `seq_lens[b]` slots `table[rows[b], :]`, no gather;
with `prefix` (slots [P] that every request's first P positions share, cascade) those keys are
read once for the whole batch. The work is split by (kv head, chunk of prefix keys) and
(request, kv head, chunk of own keys) across OpenMP threads, so one long context also uses
every thread (chunks merged exactly). The kernel is paged_decode.c, compiled by `native.build`
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
CHUNK = 512  # keys per task: long contexts split into this many-key pieces across threads
enabled = True  # tests switch the kernel off to compare against the gather path


def _declare(lib: ctypes.CDLL) -> None:
    p, i32, i64, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    lib.lm_paged_decode.argtypes = [p, p, p, i32, p, i64, p, i64, p, p, i32, i32, i32, i32, f32, i64, i32, p, p]
    lib.lm_paged_decode.restype = None


_KERNEL = native.Kernel(_SOURCE, native.NATIVE_FLAGS, True, _declare)


def available() -> bool:
    """False where the kernel cannot be built (no C compiler): callers gather K/V instead."""
    return enabled and _KERNEL.lib() is not None


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                 rows: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                 prefix: Optional[torch.Tensor] = None, max_seq_len: Optional[int] = None) -> torch.Tensor:
    """q [B, H, D]; k_cache, v_cache [slots, KV, D]; table int64 [R, L]; rows, seq_lens int64 [B];
    prefix int64 [P] (every seq_len > P) or None; max_seq_len = max(seq_lens) if the caller knows it."""
    assert available() and q.dtype == torch.float32 and k_cache.dtype == v_cache.dtype in KV_DTYPES
    assert q.shape[-1] <= MAX_D
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and table.is_contiguous()
    q, rows, seq_lens = q.contiguous(), rows.contiguous(), seq_lens.contiguous()
    B, H, D = q.shape
    KV = k_cache.shape[1]
    P = 0 if prefix is None else prefix.numel()
    prefix = table if prefix is None else prefix.to(torch.int64).contiguous()  # any valid pointer when P = 0
    pre_chunks = (P + CHUNK - 1) // CHUNK
    own_chunks = max(0 if P else 1, ((max_seq_len or int(seq_lens.max())) - P + CHUNK - 1) // CHUNK)
    scratch = torch.empty(B * KV * (pre_chunks + own_chunks) * (H // KV) * (D + 2), dtype=torch.float32)
    out = torch.empty_like(q)
    _KERNEL.lib().lm_paged_decode(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), int(k_cache.dtype == torch.bfloat16),
                         prefix.data_ptr(), P,
                         table.data_ptr(), table.stride(0), rows.data_ptr(), seq_lens.data_ptr(), B, H, KV, D,
                         scale, CHUNK, torch.get_num_threads(), scratch.data_ptr(), out.data_ptr())
    return out
