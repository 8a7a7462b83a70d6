"""Attention with FlashInfer's paged prefill/decode wrappers (GPU only).

Per batch, `init_forward_metadata` builds FlashInfer's CSR page table and `plan`s the one
wrapper the batch needs (decode when every request adds one token, else prefill with
causal masking aligned to the end of each request's KV, i.e. prefix + causal extend);
per layer, `forward` stores the new K/V and `run`s the planned wrapper.

The pool's K/V [slots, kv_heads, D] are viewed as pages of one token ([slots, 1, kv_heads,
D], layout "NHD"), so the page table is simply `req_to_token[row, :seq_len]` and works
for any allocator page size without copying the cache.
"""

from __future__ import annotations

from typing import Optional

import torch

from lmprog_runtime.attention.base import AttentionBackend
from lmprog_runtime.model_executor.forward_batch import ForwardBatch

try:
    import flashinfer
except ImportError as e:
    raise ImportError("the flashinfer attention backend needs the `flashinfer` package "
                      f"(pip install flashinfer-python, built for this torch and CUDA); importing it failed: {e}"
                      ) from e

WORKSPACE_BYTES = 128 << 20  # FlashInfer's scratch for split-KV plans; shared by both wrappers


class FlashInferAttnBackend(AttentionBackend):
    def __init__(self, token_to_kv_pool, num_heads: int, num_kv_heads: int, head_dim: int,
                 scaling: Optional[float] = None):
        super().__init__(token_to_kv_pool, num_heads, num_kv_heads, head_dim, scaling)
        device = token_to_kv_pool.k.device
        if device.type != "cuda":
            raise ValueError(f"the flashinfer attention backend needs a CUDA GPU, but the KV pool is on "
                             f"{device}; use --attention-backend torch_native on the CPU")
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.prefill_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        # tensor-core decode pays off once several query heads share a KV head
        self.decode_wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=num_heads // num_kv_heads >= 4)

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        seq_lens = fb.seq_lens_cpu or fb.seq_lens.tolist()
        extend_lens = fb.extend_lens_cpu or fb.extend_lens.tolist()
        self.decode = all(e == 1 for e in extend_lens)
        device, B = fb.seq_lens.device, len(seq_lens)
        rows = fb.req_to_token[fb.req_pool_indices, :max(seq_lens)]  # [B, S]
        used = torch.arange(rows.shape[1], device=device)[None, :] < fb.seq_lens[:, None]
        kv_indices = rows[used].to(torch.int32)  # [sum(seq_lens)] slots = one-token pages
        kv_indptr = torch.zeros(B + 1, dtype=torch.int32, device=device)
        kv_indptr[1:] = torch.cumsum(fb.seq_lens, 0)
        last_page_len = torch.ones(B, dtype=torch.int32, device=device)
        dtype = self.kv_pool.k.dtype
        common = dict(sm_scale=self.scaling, q_data_type=dtype, kv_data_type=dtype)
        if self.decode:
            self.decode_wrapper.plan(kv_indptr, kv_indices, last_page_len, self.num_heads, self.num_kv_heads,
                                     self.head_dim, 1, pos_encoding_mode="NONE", **common)
            return
        qo_indptr = torch.zeros(B + 1, dtype=torch.int32, device=device)
        qo_indptr[1:] = torch.cumsum(fb.extend_lens, 0)
        self.prefill_wrapper.plan(qo_indptr, kv_indptr, kv_indices, last_page_len, self.num_heads,
                                  self.num_kv_heads, self.head_dim, 1, causal=True, **common)

    def forward(self, q, k, v, layer_id: int, fb: ForwardBatch, save_kv_cache: bool = True) -> torch.Tensor:
        # q [T, H, D]; k, v [T, KV, D]
        if save_kv_cache:
            self.kv_pool.set_kv(layer_id, fb.out_cache_loc, k, v)
        cache = (self.kv_pool.k[layer_id].unsqueeze(1), self.kv_pool.v[layer_id].unsqueeze(1))  # [slots, 1, KV, D]
        q = q.contiguous().to(cache[0].dtype)
        wrapper = self.decode_wrapper if self.decode else self.prefill_wrapper
        out = wrapper.run(q, cache)  # [T, H, D]
        return out.view(q.shape[0], self.num_heads * self.head_dim)
