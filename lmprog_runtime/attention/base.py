"""The attention backend contract.

One backend instance serves every layer of one model. Per batch the runner calls
`init_forward_metadata(forward_batch)` once (index tables, masks, kernel plans); each
layer then calls `forward(q, k, v, layer_id, forward_batch)`, which

1. stores the new `k`, `v` into the KV pool at `forward_batch.out_cache_loc` (unless called
   with `save_kv_cache=False`: the caller has written them already, e.g. the model's fused
   rope + KV-write op on the CPU; then `k`, `v` may be None), and
2. attends each new token of request i over that request's KV at slots
   `req_to_token[req_pool_indices[i], :seq_lens[i]]`, causally: the token at
   position p sees positions 0..p (its cached prefix plus earlier new tokens).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional

import torch

from lmprog_runtime.cache.kv_pool import TokenToKVPool
from lmprog_runtime.model_executor.forward_batch import ForwardBatch


class AttentionBackend(ABC):
    def __init__(self, token_to_kv_pool: TokenToKVPool, num_heads: int, num_kv_heads: int,
                 head_dim: int, scaling: Optional[float] = None):
        assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
        self.kv_pool = token_to_kv_pool
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scaling = head_dim ** -0.5 if scaling is None else scaling

    @abstractmethod
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Prepare whatever all layers of this batch share; called once before the layers."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                forward_batch: ForwardBatch, save_kv_cache: bool = True) -> torch.Tensor:
        """q [T, heads, D], k/v [T, kv_heads, D] (new tokens, rotary applied) -> out [T, heads * D]."""

    def decode_attend(self, q: torch.Tensor, out: torch.Tensor):
        """For this batch, `attend(layer_id)`: what `forward(q, None, None, layer_id, fb,
        save_kv_cache=False)` computes, written into `out` [T, heads, D] without the per-layer
        checks and allocations (the fused decode layer calls it 30 times a step); q [T, heads, D]
        is read at each call. None where the backend has no such path for this batch."""
        return None
