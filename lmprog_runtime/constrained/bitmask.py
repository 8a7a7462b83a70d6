"""Packed int32 token bitmasks (SGLang's / llguidance's / xgrammar's layout: bit j of word w =
token 32w + j) and bool mask rows."""
from __future__ import annotations

import numpy as np
import torch


def unpack_into(bitmask_row: torch.Tensor, mask_row: torch.Tensor, n_tokens: int) -> None:
    """Set `mask_row[i]` True where bit i of the packed int32 `bitmask_row` is set (i < n_tokens).

    numpy's unpackbits is single-threaded and ~10x cheaper than torch shifts at 49k tokens.
    """
    words = bitmask_row.cpu().numpy().astype("<i4", copy=False)
    allowed = np.unpackbits(words.view(np.uint8), bitorder="little")[:n_tokens].astype(np.bool_)
    if mask_row.device.type == "cpu" and mask_row.is_contiguous():
        view = mask_row.numpy()[: allowed.shape[0]]
        np.logical_or(view, allowed, out=view)
    else:
        mask_row[: allowed.shape[0]] |= torch.from_numpy(allowed).to(mask_row.device)


def copy_words(src: np.ndarray, dst: np.ndarray) -> None:
    """The int32 bitmask row(s) `src` over `dst` of another width (the last axis): the shared
    words copied, the rest of `dst` clear (tokens past `src`'s width not allowed)."""
    n = min(src.shape[-1], dst.shape[-1])
    dst[..., :n] = src[..., :n]
    dst[..., n:] = 0


def fit_words(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """int32 bitmask rows [B, W] (on the CPU) cut or padded (clear bits: banned) to the
    ceil(vocab / 32) words of logits `vocab` wide, as the CUDA kernel takes them."""
    need = -(-vocab // 32)
    if words.shape[-1] == need:
        return words
    fit = np.empty((words.shape[0], need), dtype=np.int32)
    copy_words(words.numpy(), fit)
    return torch.from_numpy(fit)


def unpack_rows(words: np.ndarray, width: int) -> np.ndarray:
    """bool [B, width] of int32 bitmask rows [B, W] (C-contiguous): bit j of word w = column
    32w + j; columns past 32W False."""
    b = words.shape[0]
    bits = np.unpackbits(words.view(np.uint8).reshape(b, -1), axis=1, count=min(width, words.shape[1] * 32),
                         bitorder="little").view(np.bool_)
    if bits.shape[1] < width:
        bits = np.concatenate([bits, np.zeros((b, width - bits.shape[1]), dtype=np.bool_)], axis=1)
    return bits
