"""Weight-only quantized linear layers for the CPU decode path.

Two formats:
- `int8`: one symmetric scale per output row; `w[n, k] = q[n, k] * scale[n]`, q in [-127, 127]
  (lmprog's own kernel, qgemm.py, with float32 activations; `aten._weight_int8pack_mm` otherwise).
- `int4`: groups of `INT4_GROUP` inputs per output row, asymmetric;
  `w[n, k] = (q[n, k] - 8) * scale[n, g] + zero[n, g]`, q in [0, 15], g = k // INT4_GROUP
  (`aten._weight_int4pack_mm_for_cpu` on torch's packed layout; lmprog's qgemm.c, in its own
  layout, with float32 activations).
GGUF Q4_0 / Q4_1 blocks (32 values, fp16 scale [and min]) are exactly this int4 format with
group 32, so `gguf_q4_blocks` converts them without a second rounding.

A `QuantLinear` may also keep the dense weight: batches of at least `dense_rows` rows (prefill,
large decode batches) are faster through the dense GEMM on CPUs whose quantized kernels are
built for latency, and the runner's probe decides where that crossover lies.
Activations enter and leave in the model dtype; the kernel runs in `act_dtype` (the probe picks
float32 or bfloat16: torch's quantized CPU kernels are fast only for some dtypes on some CPUs;
or torch.int8: lmprog's integer-dot kernels, qdot.c, which quantize each activation row per
call in blocks of 32 and keep the float32 kernels' weight buffers).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Dict, Optional, Tuple

import numpy as np
import torch
from torch import nn

from lmprog_runtime.model_executor import qgemm

QUANT_MODES = ("none", "int8", "int4", "auto")
QUANT_FORMATS = ("int8", "int4")
INT4_GROUP = 32  # GGUF's block length; torch's int4 kernel accepts 32, 64, 128 or 256
INT4_INNER_K_TILES = 1  # ignored by the CPU packer; kept for the op's signature

# (q int32 [N, K] in 0..15, scale [N, K/32] float32, zero [N, K/32] float32), see the docstring
Int4Blocks = Tuple[torch.Tensor, torch.Tensor, torch.Tensor]

_CHOICE = threading.local()  # decode_rows(): the row count that picks dense copy or kernel


@contextlib.contextmanager
def decode_rows(n: int):
    """Within: a step's rows are n requests' decode-like positions (a verify step: each row is
    what a one-token decode would compute there), so each layer picks its dense copy or its
    kernel as for an n-row step, not by its row count. A verify row then runs the kernel the
    decode it replaces runs, row by row alike (the kernels are batch-invariant), and greedy
    speculation stays token-identical where a step of many rows would have crossed dense_rows."""
    prev = getattr(_CHOICE, "rows", None)
    _CHOICE.rows = n
    try:
        yield
    finally:
        _CHOICE.rows = prev


def choice_rows(T: int) -> int:
    """The row count a T-row step picks its kernels by (see decode_rows)."""
    n = getattr(_CHOICE, "rows", None)
    return T if n is None else n


# -- quantizers ------------------------------------------------------------------------------------
def quantize_int8(w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (q int8 [N, K], scale float32 [N]); |w - q*scale| <= scale / 2."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / 127).clamp_min(1e-12)
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def quantize_int4(w: torch.Tensor, group: int = INT4_GROUP) -> Int4Blocks:
    """w [N, K] float -> min/max int4 blocks; |w - deq| <= scale / 2 per group."""
    w = w.float()
    n, k = w.shape
    wg = w.reshape(n, k // group, group)
    lo, hi = wg.amin(dim=-1), wg.amax(dim=-1)  # [N, K/g]
    scale = ((hi - lo) / 15).clamp_min(1e-12)
    q = torch.round((wg - lo[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.int32)
    return q.reshape(n, k), scale, lo + 8 * scale


def dequantize_int4(blocks: Int4Blocks, group: int = INT4_GROUP) -> torch.Tensor:
    """The float32 weight [N, K] that int4 blocks stand for."""
    q, scale, zero = blocks
    n, k = q.shape
    w = (q.reshape(n, k // group, group).float() - 8) * scale[..., None] + zero[..., None]
    return w.reshape(n, k)


def gguf_q4_blocks(raw: np.ndarray, kind: str) -> Int4Blocks:
    """GGUF Q4_0 / Q4_1 rows -> int4 blocks, exactly.

    raw: uint8 [rows, K/32 * B] (B = 18 for Q4_0: fp16 d + 16 bytes; 20 for Q4_1: fp16 d, fp16 m
    + 16 bytes). Byte j of a block holds value j in its low nibble and value j + 16 in its high one.
    Q4_0: w = (q - 8) * d -> zero 0.  Q4_1: w = q * d + m -> zero m + 8 d.
    """
    head = {"Q4_0": 2, "Q4_1": 4}[kind]
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(rows, -1, head + 16)  # [rows, K/32, B]
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [rows, K/32]
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if head == 4 else np.zeros_like(d)
    qs = blocks[..., head:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int32).reshape(rows, -1)  # [rows, K]
    zero = m + 8 * d if head == 4 else np.zeros_like(d)
    return torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(zero)


# -- the layer -------------------------------------------------------------------------------------
class QuantLinear(nn.Module):
    """`y = x @ W.T + b` with W stored as `fmt` ("int8" | "int4"); x [T, K] -> y [T, N], x's dtype.

    Buffers (all saved in the state dict, so a converted model reloads from safetensors):
    int8: qweight int8 [N, K], scales act_dtype [N] (float32 for int8 activations; qdot.c's
      kernel (int8 activations) takes qweight in its own row order, `qgemm.pack_q8`);
    int4: qweight uint8 [N, K/2] (torch's CPU packing), scale_zeros act_dtype [K/32, N, 2];
      with float32 or int8 activations and qgemm.c built (`native4`): qweight in qgemm.c's
      nibble order, scale_zeros float32 [N, K/32, 2] (scale, zero - 8 * scale); with int8
      activations (qdot.c) both in its layout (`qgemm.pack_q4_f16`: rows in groups of 8),
      scale_mins float16 [N, K/32, 2] instead, the same pairs;
    dense (optional): the weight the kernel stands for, dequantized, [N, K], used when
      T >= dense_rows.
    """

    def __init__(self, fmt: str, out_features: int, in_features: int, act_dtype: torch.dtype,
                 bias: bool = False, dense_rows: Optional[int] = None, dense_dtype=torch.float32,
                 dense_weight_dtype: Optional[torch.dtype] = None):
        super().__init__()
        assert fmt in QUANT_FORMATS, fmt
        self.fmt, self.act_dtype, self.dense_rows = fmt, act_dtype, dense_rows
        self.out_features, self.in_features = out_features, in_features
        n, k = out_features, in_features
        # float32 int4 runs on qgemm.c, in its own layout (torch's float32 int4 kernel is slow);
        # int8 activations (qdot.c) share that layout and the float32 one of int8 weights
        int8_act = act_dtype == torch.int8
        if int8_act and not qgemm.available():
            raise ValueError("int8 activations run on lmprog's C kernels, which are not built here")
        self.native4 = fmt == "int4" and (act_dtype == torch.float32 or int8_act) and qgemm.available()
        self._c_kernel = _c_kernel_name(fmt, act_dtype, in_features)  # None: torch's kernels
        self._c_bound = None  # _bind_c's arguments for the C kernel
        if fmt == "int8":
            self.register_buffer("qweight", torch.empty(n, k, dtype=torch.int8))
            self.register_buffer("scales", torch.empty(n, dtype=torch.float32 if int8_act else act_dtype))
        elif self._c_kernel == "int4x8":
            self.register_buffer("qweight", torch.empty(n, k // 2, dtype=torch.uint8))
            self.register_buffer("scale_mins", torch.empty(n, k // INT4_GROUP, 2, dtype=torch.float16))
        elif self.native4:
            self.register_buffer("qweight", torch.empty(n, k // 2, dtype=torch.uint8))
            self.register_buffer("scale_zeros", torch.empty(n, k // INT4_GROUP, 2, dtype=torch.float32))
        else:
            self.register_buffer("qweight", torch.empty(n, k // 2, dtype=torch.uint8))
            self.register_buffer("scale_zeros", torch.empty(k // INT4_GROUP, n, 2, dtype=act_dtype))
        self.register_buffer("bias", torch.empty(n, dtype=dense_dtype) if bias else None)
        # the kept dense copy may be in another dtype than the activations (float32 activations
        # beside bfloat16 GEMMs for prefill, where the CPU has bfloat16 dot products)
        self.register_buffer("dense", torch.empty(n, k, dtype=dense_weight_dtype or dense_dtype) if dense_rows else None)

    @staticmethod
    def supports(fmt: str, out_features: int, in_features: int) -> bool:
        return fmt == "int8" or (in_features % INT4_GROUP == 0 and out_features % 16 == 0)

    @torch.no_grad()
    def set_weight(self, w: Optional[torch.Tensor], int4: Optional[Int4Blocks] = None) -> None:
        """Quantize `w` [N, K] (or take exact `int4` blocks) into the buffers; keep w if dense."""
        if self.fmt == "int8":
            q, scale = quantize_int8(w)
            self.qweight.copy_(qgemm.pack_q8(q) if self._c_kernel == "int8x8" else q)
            self.scales.copy_(scale)
            stored = q.float() * self.scales.float()[:, None]
        elif self.native4:
            blocks = int4 if int4 is not None else quantize_int4(w)
            f16 = self._c_kernel == "int4x8"
            packed, sz = (qgemm.pack_q4_f16 if f16 else qgemm.pack_q4)(*blocks)
            (self.scale_mins if f16 else self.scale_zeros).copy_(sz)
            self.qweight.copy_(packed)
            q = blocks[0]
            if f16:  # (qdot's layout interleaves rows: its q and (s, m) read back row by row)
                q, sz = qgemm.unpack_q4_f16(packed, sz)
            stored = q.float() * _per_input(sz[..., 0]) + _per_input(sz[..., 1])
        else:
            q, scale, zero = int4 if int4 is not None else quantize_int4(w)
            self.qweight.copy_(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), INT4_INNER_K_TILES))
            self.scale_zeros.copy_(torch.stack([scale.t(), zero.t()], dim=-1))
            sz = self.scale_zeros.float()  # rounded to act_dtype, as the kernel reads it
            stored = dequantize_int4((q, sz[..., 0].t(), sz[..., 1].t()))
        if self.dense is not None:
            # the weight the quantized kernel computes with, not `w`: which path a row takes then
            # changes only rounding, not the model (a prompt and its decode see one set of weights)
            self.dense.copy_(stored)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense_rows is not None and choice_rows(x.shape[0]) >= self.dense_rows:  # dense exists iff dense_rows
            # the activations take the weight's dtype, never the weight the activations'
            y = nn.functional.linear(x.to(self.dense.dtype), self.dense).to(x.dtype)
            return y if self.bias is None else y + self.bias.to(x.dtype)
        if self._c_kernel is not None and x.is_cpu:
            return self._c_forward(x)
        xa = x.to(self.act_dtype)
        if self.fmt == "int8":
            y = torch.ops.aten._weight_int8pack_mm(xa, self.qweight, self.scales)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(xa, self.qweight, INT4_GROUP, self.scale_zeros)
        y = y.to(x.dtype)
        return y if self.bias is None else y + self.bias.to(x.dtype)

    def _c_forward(self, x: torch.Tensor) -> torch.Tensor:
        """qgemm.c / qdot.c called directly: the decode path's ~120 calls a step pay no checks
        (shapes were fixed at construction), no module attribute lookups (the kernel's
        arguments are bound once per buffer object) and one allocation, the output [T, N]."""
        xa = x if x.dtype == torch.float32 else x.float()
        if not xa.is_contiguous():
            xa = xa.contiguous()
        bound, bufs = self._c_bound, self._buffers
        if bound is None or bufs["qweight"] is not bound[0] or bufs[bound[1]] is not bound[2]:
            bound = self._bind_c()
        fn, K, N, q_ptr, s_ptr = bound[3:]
        T = xa.shape[0]
        y = torch.empty(T, N, dtype=torch.float32)
        if fn(xa.data_ptr(), T, K, q_ptr, s_ptr, N, y.data_ptr(), torch.get_num_threads()):
            raise MemoryError(f"{self._c_kernel}: no memory for the activation scratch")
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        bias = self._buffers["bias"]
        return y if bias is None else y + bias.to(x.dtype)

    def _bind_c(self):
        """(qweight, scales' name, scales, C function, K, N, weight pointer, scales pointer) for
        `_c_forward`; rebound whenever a buffer object changes (state-dict loads with assign,
        `.to()`), while in-place copies (`set_weight`, plain loads) keep the pointers. Holding
        the two tensors keeps the pointers' storage alive."""
        name = "scales" if self.fmt == "int8" else ("scale_mins" if self._c_kernel == "int4x8" else "scale_zeros")
        q, scales = self.qweight, getattr(self, name)
        assert q.is_contiguous() and scales.is_contiguous() and scales.dtype in (torch.float32, torch.float16)
        self._c_bound = (q, name, scales, qgemm.c_fn(self._c_kernel), self.in_features, self.out_features,
                         q.data_ptr(), scales.data_ptr())
        return self._c_bound

    def extra_repr(self) -> str:
        return (f"{self.fmt}, in={self.in_features}, out={self.out_features}, act={self.act_dtype}, "
                f"dense_rows={self.dense_rows}")


def on_c_kernels(act_dtype: torch.dtype) -> bool:
    """Layers with this kernel dtype run lmprog's C kernels (float32 or int8 activations, where
    qgemm.c is built), whose decode steps fuse (llama_layer.py); others run torch's."""
    return act_dtype in (torch.float32, torch.int8) and qgemm.available()


def _c_kernel_name(fmt: str, act_dtype: torch.dtype, in_features: int) -> Optional[str]:
    """qgemm.py's name of the C kernel a layer runs (None: torch's). int8 activations fall back
    to the float32 kernel (same buffers) where qdot.c is not built or K is no multiple of 32."""
    if not on_c_kernels(act_dtype):
        return None
    if act_dtype == torch.int8 and in_features % INT4_GROUP == 0 and qgemm.dot_available():
        return fmt + "x8"
    return fmt


def _per_input(per_group: torch.Tensor) -> torch.Tensor:
    """[N, K/group] -> [N, K]: each group's value repeated over its inputs."""
    return per_group.float().repeat_interleave(INT4_GROUP, dim=1)


# -- the model ---------------------------------------------------------------------------------------
def quantize_model(model: nn.Module, fmt: str, act_dtype: torch.dtype, dense_rows: Optional[int] = None,
                   int4_sources: Optional[Dict[str, Int4Blocks]] = None, empty: bool = False,
                   dense_weight_dtype: Optional[torch.dtype] = None) -> int:
    """Replace the model's projections and its logits head by `QuantLinear(fmt)`; return how many.

    The layers' `nn.Linear`s are swapped in place; the head becomes `model.quant_head` (the
    embedding stays dense for lookups when tied). int4 layers take exact GGUF blocks from
    `int4_sources` (HF weight name -> blocks) where every fused shard has them. The head is
    always int8 (GGUF files keep it in 8 bits, and 4-bit logits measured too coarse).
    `empty=True` builds the structure only, for a state dict loaded afterwards. Kept dense
    copies (`dense_rows`) are in `dense_weight_dtype`, default the model's.
    """
    targets = [(name, mod) for name, mod in model.named_modules()
               if isinstance(mod, nn.Linear) and name.startswith("layers.")]
    count = 0
    for name, lin in targets:
        if not QuantLinear.supports(fmt, lin.out_features, lin.in_features):
            continue
        q = _quant_like(lin, fmt, act_dtype, dense_rows, dense_weight_dtype)
        if not empty:
            blocks = _fused_int4_blocks(model, name, int4_sources) if fmt == "int4" else None
            q.set_weight(lin.weight.data if blocks is None else None, int4=blocks)
            if lin.bias is not None:
                q.bias.copy_(lin.bias.data)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, q)
        count += 1
    head = model.lm_head if model.lm_head is not None else model.embed_tokens
    model.quant_head = QuantLinear("int8", head.weight.shape[0], head.weight.shape[1], act_dtype,
                                   dense_rows=dense_rows, dense_dtype=head.weight.dtype,
                                   dense_weight_dtype=dense_weight_dtype)
    if not empty:
        model.quant_head.set_weight(head.weight.data)
    model.lm_head = None  # an untied head lives on in quant_head (and its dense copy, if kept)
    return count + 1


def _quant_like(lin: nn.Linear, fmt, act_dtype, dense_rows, dense_weight_dtype=None) -> QuantLinear:
    return QuantLinear(fmt, lin.out_features, lin.in_features, act_dtype, bias=lin.bias is not None,
                       dense_rows=dense_rows, dense_dtype=lin.weight.dtype, dense_weight_dtype=dense_weight_dtype)


def _fused_int4_blocks(model, module_name: str, sources) -> Optional[Int4Blocks]:
    """Exact blocks for `layers.{i}.<fused>` from its HF shards, or None when any shard lacks them."""
    if not sources:
        return None
    shards = model.hf_shard_names(module_name + ".weight")
    parts = [sources.get(s) for s in shards]
    if any(p is None for p in parts):
        return None
    return tuple(torch.cat([p[i] for p in parts], dim=0) for i in range(3))
