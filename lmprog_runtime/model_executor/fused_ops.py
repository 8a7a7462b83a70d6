"""Fused CPU ops for the decode step (fused_ops.c): one C call where torch dispatches several
small ops whose cost is all dispatch (an RMSNorm with its residual add: 5-7 ops, ~35 us on a
[1, 576] row against ~3 us here), and `silu_mul` for the quantized models' MLP (one call for
split + silu + multiply; its exp is a polynomial, so it is used on both of their decode paths,
never on float32 / dense models, whose outputs stay torch's). Compiled by `native.build` at first use; `available()` is
False where that is impossible, and the model keeps its torch ops. float32 only; the sum of
squares is taken in another order than torch's, so results agree to float32 rounding, not bits.
"""

from __future__ import annotations

import ctypes
import pathlib
from typing import Optional, Tuple

import torch

from lmprog_runtime import native


def _declare(lib: ctypes.CDLL) -> None:
    p, i32, i64, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    lib.lm_add_rms_norm.argtypes = [p, p, p, p, p, i64, i64, f32, i32]
    lib.lm_add_rms_norm.restype = None
    lib.lm_silu_mul.argtypes = [p, i64, i64, p, i32]
    lib.lm_silu_mul.restype = None


_KERNEL = native.Kernel(pathlib.Path(__file__).with_name("fused_ops.c"), native.NATIVE_FLAGS, True, _declare)
enabled = True  # tests switch the C ops off to compare against torch's


def available() -> bool:
    return enabled and _KERNEL.lib() is not None


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.dtype == weight.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 2
            and x.is_contiguous() and weight.is_contiguous() and available())


def act_usable(x: torch.Tensor) -> bool:
    """x is a float32 contiguous 2-D CPU activation and the ops are built (`silu_mul`)."""
    return x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 2 and x.is_contiguous() and available()


def add_rms_norm(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
                 eps: float) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(rms_norm(x + residual) * weight, x + residual), or (rms_norm(x) * weight, None) without a
    residual; x, residual float32 [T, H] contiguous (`usable`)."""
    T, H = x.shape
    out = torch.empty_like(x)
    total = None
    if residual is not None:
        residual = residual.contiguous()
        total = torch.empty_like(x)
    _KERNEL.lib().lm_add_rms_norm(x.data_ptr(), 0 if residual is None else residual.data_ptr(),
                         0 if total is None else total.data_ptr(), weight.data_ptr(), out.data_ptr(), T, H,
                         eps, torch.get_num_threads())
    return out, total


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up float32 [T, 2I] contiguous (gate | up) -> silu(gate) * up [T, I] (fused_ops.c's
    polynomial exp: within 2e-7 relative of torch's for |gate| < 80, not its bits; below -87 the clamped
    exp leaves ~1e-36 absolute); `act_usable(gate_up)`."""
    T, I2 = gate_up.shape
    out = torch.empty(T, I2 // 2, dtype=torch.float32)
    _KERNEL.lib().lm_silu_mul(gate_up.data_ptr(), T, I2 // 2, out.data_ptr(), torch.get_num_threads())
    return out


def c_function_address(name: str) -> int:
    """The address of fused_ops.c's exported `name` (llama_layer.c calls it through a pointer)."""
    return ctypes.cast(getattr(_KERNEL.lib(), name), ctypes.c_void_p).value
