"""Packed int32 token bitmasks (llguidance / xgrammar layout) -> bool mask rows."""
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
