"""Grammar masks on the GPU: pack the allowed-token mask into a bitmask, apply it with Triton.

The sampler's CPU path applies a bool mask [B, V] (True = allowed) with `masked_fill_`.
On CUDA the mask travels as a bitmask instead, 32x smaller to copy to the device:
`bitmask[b, w]` (int32) has bit j set iff token `32 * w + j` is allowed for row b.
`apply_token_bitmask_` sets every disallowed logit to -inf in place, one program per
(row, BLOCK tokens). Imported only on the CUDA path (it imports triton).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024  # tokens per program


@triton.jit
def _apply_token_bitmask_kernel(Logits, Bitmask, vocab, stride_l, stride_b, BLOCK: tl.constexpr):
    row, blk = tl.program_id(0), tl.program_id(1)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    in_vocab = offs < vocab
    words = tl.load(Bitmask + row * stride_b + offs // 32, mask=in_vocab, other=0)
    allowed = ((words >> (offs % 32)) & 1) != 0
    tl.store(Logits + row * stride_l + offs, float("-inf"), mask=in_vocab & ~allowed)


def pack_token_bitmask(mask: torch.Tensor) -> torch.Tensor:
    """bool [B, V] (True = allowed) -> int32 [B, ceil(V / 32)], bit j of word w = token 32w + j."""
    if mask.dtype != torch.bool or mask.dim() != 2:
        raise ValueError(f"expected a bool mask [batch, vocab], got {mask.dtype} {tuple(mask.shape)}")
    B, V = mask.shape
    pad = -V % 32
    if pad:
        mask = torch.cat([mask, mask.new_zeros(B, pad)], dim=1)
    bits = torch.arange(32, device=mask.device, dtype=torch.int64)
    words = (mask.view(B, -1, 32).to(torch.int64) << bits).sum(-1)  # [B, W] in [0, 2^32)
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words)  # two's complement int32
    return words.to(torch.int32)


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [B, V] float (modified in place, returned); bitmask int32 [B, ceil(V / 32)], same device."""
    B, V = logits.shape
    if bitmask.shape != (B, -(-V // 32)) or bitmask.dtype != torch.int32:
        raise ValueError(f"expected an int32 bitmask of shape {(B, -(-V // 32))} for logits {(B, V)}, "
                         f"got {bitmask.dtype} {tuple(bitmask.shape)}")
    assert logits.stride(-1) == 1 and bitmask.stride(-1) == 1
    if B:
        _apply_token_bitmask_kernel[(B, triton.cdiv(V, _BLOCK))](
            logits, bitmask, V, logits.stride(0), bitmask.stride(0), BLOCK=_BLOCK)
    return logits
