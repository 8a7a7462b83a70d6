"""lmprog's own weight-only int8 and int4 matmuls for the CPU (qgemm.c), used by `QuantLinear`
with float32 activations: `q8_matmul(x, q, scale)` = x @ (q * scale[:, None]).T, and
`q4_matmul(x, *pack_q4(q, scale, zero))` = x @ dequantize_int4((q, scale, zero)).T.

torch's `_weight_int8pack_mm` is fast only with bfloat16 activations on some CPUs (measured
5x slower than the dense float32 GEMM with float32 ones on an AVX-512 Xeon); this kernel
streams each int8 weight once per call and widens it in registers, so a decode step reads a
quarter of the dense float32 bytes. Compiled by `native.build` at first use (-march=native);
`available()` is False where that is impossible and QuantLinear keeps torch's kernel.
"""

from __future__ import annotations

import ctypes
import pathlib

import torch

from lmprog_runtime import native


def _declare(lib: ctypes.CDLL) -> None:
    p, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    lib.lm_q8_gemm.argtypes = [p, i32, i32, p, p, i64, p, i32]
    lib.lm_q8_gemm.restype = None
    lib.lm_q4_gemm.argtypes = [p, i32, i32, p, p, i64, p, p, i32]
    lib.lm_q4_gemm.restype = None


_KERNEL = native.Kernel(pathlib.Path(__file__).with_name("qgemm.c"), native.NATIVE_FLAGS, True, _declare)
enabled = True  # tests switch the kernel off to compare against torch's


def available() -> bool:
    return enabled and _KERNEL.lib() is not None


def q8_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x float32 [T, K], q int8 [N, K] contiguous, scale float32 [N] -> y float32 [T, N]."""
    assert available() and x.dtype == scale.dtype == torch.float32 and q.dtype == torch.int8
    assert q.is_contiguous() and scale.is_contiguous() and x.shape[1] == q.shape[1]
    x = x.contiguous()
    T, K = x.shape
    y = torch.empty(T, q.shape[0], dtype=torch.float32)
    _KERNEL.lib().lm_q8_gemm(x.data_ptr(), T, K, q.data_ptr(), scale.data_ptr(), q.shape[0], y.data_ptr(),
                    torch.get_num_threads())
    return y


def pack_q4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor):
    """int4 blocks (q int32 [N, K] in 0..15, scale, zero [N, K/32]; w = (q - 8) * scale + zero)
    -> (packed uint8 [N, K/2], sz float32 [N, K/32, 2]) in qgemm.c's layout."""
    n, k = q.shape
    qg = q.reshape(n, k // 32, 32).to(torch.uint8)
    packed = (qg[..., :16] | (qg[..., 16:] << 4)).reshape(n, k // 2)
    scale = scale.float()
    sz = torch.stack([scale, zero.float() - 8 * scale], dim=-1)
    return packed.contiguous(), sz.contiguous()


def q4_matmul(x: torch.Tensor, packed: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
    """x float32 [T, K], packed uint8 [N, K/2], sz float32 [N, K/32, 2] -> y float32 [T, N]."""
    assert available() and x.dtype == sz.dtype == torch.float32 and packed.dtype == torch.uint8
    assert packed.is_contiguous() and sz.is_contiguous() and x.shape[1] == 2 * packed.shape[1]
    x = x.contiguous()
    T, K = x.shape
    y = torch.empty(T, packed.shape[0], dtype=torch.float32)
    xsum = torch.empty(T, K // 32, dtype=torch.float32)
    _KERNEL.lib().lm_q4_gemm(x.data_ptr(), T, K, packed.data_ptr(), sz.data_ptr(), packed.shape[0], y.data_ptr(),
                    xsum.data_ptr(), torch.get_num_threads())
    return y
