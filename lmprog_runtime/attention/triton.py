"""Attention with Triton kernels (`triton_kernels.py`): the default GPU backend.

Per batch, `init_forward_metadata` derives what every layer shares (where each request's
new tokens start, the number of KV splits for decode, the split-K scratch buffers); per
layer, `forward` stores the new K/V and launches either the decode kernels (every request
adds one token) or the extend kernel (prefill over a cached prefix, mixed batches too,
and draft trees through their mask: `ForwardBatch.tree_masks`).

Runs on CUDA tensors; on the CPU only inside Triton's interpreter (`TRITON_INTERPRET=1`,
slow, for tests), otherwise construction fails with a message that says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from lmprog_runtime.attention.base import AttentionBackend
from lmprog_runtime.config import TRITON_INTERPRET
from lmprog_runtime.model_executor.forward_batch import ForwardBatch

try:
    from lmprog_runtime.attention import triton_kernels as kernels
except ModuleNotFoundError as e:
    if e.name != "triton":
        raise
    raise ImportError("the triton attention backend needs the `triton` package "
                      "(pip install 'triton>=3.0'); it is not installed") from e


@dataclass(frozen=True)
class TritonTuning:
    """Tile sizes and split-K policy. Defaults suit a Hopper/Ampere GPU; tests pass tiny tiles
    so the interpreter exercises multi-block loops and several splits on small shapes."""

    block_m: int = 64  # new tokens per extend program
    block_n: int = 64  # KV positions per inner-loop step
    max_kv_splits: int = 16  # upper bound of decode splits per request
    min_split_len: int = 256  # never split a context into pieces shorter than this
    num_warps: int = 4


class TritonAttnBackend(AttentionBackend):
    def __init__(self, token_to_kv_pool, num_heads: int, num_kv_heads: int, head_dim: int,
                 scaling: Optional[float] = None, tuning: Optional[TritonTuning] = None):
        super().__init__(token_to_kv_pool, num_heads, num_kv_heads, head_dim, scaling)
        device = token_to_kv_pool.k.device
        if device.type != "cuda" and not TRITON_INTERPRET:
            raise ValueError(f"the triton attention backend needs a CUDA device, but the KV pool is on "
                             f"{device}; use --attention-backend torch_native on the CPU "
                             f"(or TRITON_INTERPRET=1 to run the kernels in Triton's slow interpreter)")
        self.tuning = tuning or TritonTuning()
        self.num_sms = (torch.cuda.get_device_properties(device).multi_processor_count
                        if device.type == "cuda" else 8)

    # -- once per batch ---------------------------------------------------------------------
    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        seq_lens = fb.seq_lens_cpu or fb.seq_lens.tolist()
        extend_lens = fb.extend_lens_cpu or fb.extend_lens.tolist()
        self.decode = all(e == 1 for e in extend_lens)
        self.req_pool_indices = fb.req_pool_indices
        self.seq_lens = fb.seq_lens
        if self.decode:
            self.num_splits = self._num_kv_splits(len(seq_lens), max(seq_lens))
            shape = (len(seq_lens), self.num_heads, self.num_splits)
            device = fb.seq_lens.device
            self.mid_o = torch.empty(*shape, self.head_dim, dtype=torch.float32, device=device)
            self.mid_lse = torch.empty(*shape, dtype=torch.float32, device=device)
        else:
            self.extend_lens = fb.extend_lens
            self.extend_start = torch.cumsum(fb.extend_lens, 0) - fb.extend_lens  # [B]
            self.max_extend_len = max(extend_lens)
            self.tree_mask, self.tree_off = _flat_tree_masks(fb.tree_masks, fb.seq_lens.device)

    def _num_kv_splits(self, batch: int, max_len: int) -> int:
        """Enough (request, kv head, split) programs to fill the GPU twice over, but no split
        shorter than `min_split_len` and at most `max_kv_splits`."""
        t = self.tuning
        by_length = -(-max_len // t.min_split_len)
        by_occupancy = -(-2 * self.num_sms // (batch * self.num_kv_heads))
        return max(1, min(t.max_kv_splits, by_length, by_occupancy))

    # -- per layer ----------------------------------------------------------------------------
    def forward(self, q, k, v, layer_id: int, fb: ForwardBatch, save_kv_cache: bool = True) -> torch.Tensor:
        # q [T, H, D]; k, v [T, KV, D]
        if save_kv_cache:
            self.kv_pool.set_kv(layer_id, fb.out_cache_loc, k, v)
        k_cache, v_cache = self.kv_pool.k[layer_id], self.kv_pool.v[layer_id]  # [slots, KV, D]
        q = q.contiguous()
        o = torch.empty_like(q)  # [T, H, D]
        t = self.tuning
        if self.decode:
            kernels.decode_attention(q, o, k_cache, v_cache, fb.req_to_token, self.req_pool_indices,
                                     self.seq_lens, self.mid_o, self.mid_lse, self.num_splits,
                                     self.scaling, block_n=t.block_n, num_warps=t.num_warps)
        else:
            kernels.extend_attention(q, o, k_cache, v_cache, fb.req_to_token, self.req_pool_indices,
                                     self.seq_lens, self.extend_lens, self.extend_start,
                                     self.max_extend_len, self.scaling, block_m=t.block_m,
                                     block_n=t.block_n, num_warps=t.num_warps,
                                     tree_mask=self.tree_mask, tree_off=self.tree_off)
        return o.view(q.shape[0], self.num_heads * self.head_dim)


def _flat_tree_masks(masks, device):
    """ForwardBatch.tree_masks → (int8 [sum e*e] row-major masks, int64 [B] offsets, -1 = causal),
    or (None, None) when no request verifies a tree."""
    if masks is None or all(m is None for m in masks):
        return None, None
    flat, offsets, total = [], [], 0
    for m in masks:
        if m is None:
            offsets.append(-1)
            continue
        offsets.append(total)
        flat.append(m.reshape(-1).to(torch.int8))
        total += m.numel()
    return (torch.cat(flat).to(device), torch.tensor(offsets, dtype=torch.int64, device=device))
