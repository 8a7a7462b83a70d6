"""A fused float32 CPU op of the decoder layer (decode_ops.c), one C call where torch
dispatches many tiny ops: `rope_kv` (rope of q and k + the K/V cache write: ~15 ops per layer,
~38 us against ~8 us at batch 1 on a busy 2-core Xeon). Compiled by `native.build` at first use with
-ffp-contract=off, so rope is bit-identical to `llama.apply_rope`; `available()` is False
where a C compiler is missing and the model keeps its torch ops. Tests compare both paths
(tests/runtime/test_decode_ops.py).
"""

from __future__ import annotations

import ctypes
import pathlib

import torch

from lmprog_runtime import native


def _declare(lib: ctypes.CDLL) -> None:
    p, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    lib.lm_rope_kv.argtypes = [p, i64, i32, i32, i32, p, p, p, p, p, p, i32, i64, i64, i32]
    lib.lm_rope_kv.restype = ctypes.c_int


_FLAGS = (*native.NATIVE_FLAGS, "-ffp-contract=off")
_KERNEL = native.Kernel(pathlib.Path(__file__).with_name("decode_ops.c"), _FLAGS, True, _declare)
enabled = True  # tests switch the C op off to compare paths
KV_DTYPES = (torch.float32, torch.bfloat16)  # K/V caches rope_kv writes


def available() -> bool:
    return enabled and _KERNEL.lib() is not None


def usable(x: torch.Tensor) -> bool:
    """x is a float32 contiguous CPU activation, and the kernels are built."""
    return x.dtype == torch.float32 and x.device.type == "cpu" and x.is_contiguous() and available()


def rope_kv(qkv: torch.Tensor, heads: int, kv_heads: int, table: torch.Tensor, positions: torch.Tensor,
            slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """qkv float32 [T, (H + 2 KV) * D] contiguous; table float32 [P, 2, D] (llama.rope_cos_sin_table);
    positions, slots int64 [T]; k_cache, v_cache float32 or bfloat16 (rounded to nearest even, as
    `.to(torch.bfloat16)` rounds) [slots, KV, D] contiguous, written in place. Returns the rotated
    queries [T, H, D]."""
    T = qkv.shape[0]
    D = table.shape[-1]
    assert qkv.shape[1] == (heads + 2 * kv_heads) * D and usable(qkv) and table.dtype == torch.float32
    assert k_cache.dtype == v_cache.dtype and k_cache.dtype in KV_DTYPES
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert k_cache.shape[1:] == (kv_heads, D) and table.is_contiguous()
    positions, slots = positions.contiguous(), slots.contiguous()
    assert positions.dtype == slots.dtype == torch.int64 and positions.numel() == slots.numel() == T
    q = torch.empty(T, heads, D, dtype=torch.float32)
    if _KERNEL.lib().lm_rope_kv(qkv.data_ptr(), T, heads, kv_heads, D, table.data_ptr(), positions.data_ptr(),
                                slots.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                                int(k_cache.dtype == torch.bfloat16), table.shape[0], k_cache.shape[0],
                                torch.get_num_threads()):
        raise IndexError(f"rope_kv: a position outside [0, {table.shape[0]}) or a KV slot outside "
                         f"[0, {k_cache.shape[0]})")
    return q
