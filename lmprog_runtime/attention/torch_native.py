"""Attention with plain PyTorch: the CPU path and the correctness oracle for other backends.

- Decode batches (every request adds one token): K/V of all requests are gathered
  into one tensor padded to the batch's longest sequence and attended with a single
  masked `scaled_dot_product_attention` per layer. Query heads are grouped per KV
  head ([B, kv_heads, group, D]) so GQA needs no repeated K/V.
- Extend batches (prefill over a cached prefix, possibly mixed with decodes): one
  SDPA per request, causal with the prefix offset.
"""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.nn.functional as F

from lmprog_runtime.attention.base import AttentionBackend
from lmprog_runtime.model.forward_batch import ForwardBatch


# Decode batches of at least this many requests that share at least this many KV slots
# take the cascade path (the shared prefix is gathered once, not once per request).
CASCADE_MIN_BATCH = 4
CASCADE_MIN_SHARED = 256


class TorchNativeAttnBackend(AttentionBackend):
    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        seq_lens = fb.seq_lens_cpu or fb.seq_lens.tolist()
        extend_lens = fb.extend_lens_cpu or fb.extend_lens.tolist()
        rows = fb.req_to_token[fb.req_pool_indices]  # [B, max_context]
        starts = [0]
        for e in extend_lens[:-1]:
            starts.append(starts[-1] + e)
        # Requests adding one token (decodes, also inside a mixed batch) are attended together;
        # longer extends (prefill chunks) one by one.
        dec = [i for i, e in enumerate(extend_lens) if e == 1]
        self.all_decode = len(dec) == len(extend_lens)
        self.decode_tokens = torch.tensor([starts[i] for i in dec], dtype=torch.int64, device=rows.device)
        if dec:
            self._init_decode(rows[dec] if not self.all_decode else rows, [seq_lens[i] for i in dec])
        # extend: per request, its slots and (when it has a cached prefix) a causal mask with offset
        self.extends = []  # (slots [s], mask [e, s] or None for plain causal, start, e)
        for i, (s, e) in enumerate(zip(seq_lens, extend_lens)):
            if e == 1:
                continue
            mask = None
            if s != e:
                q_pos = torch.arange(s - e, s, device=rows.device)[:, None]  # [e, 1]
                mask = torch.arange(s, device=rows.device)[None, :] <= q_pos  # [e, s]
            self.extends.append((rows[i, :s], mask, starts[i], e))

    def _init_decode(self, rows: torch.Tensor, seq_lens: List[int]) -> None:
        max_len = max(seq_lens)
        self.shared = P = self._shared_prefix_len(rows, seq_lens)
        self.prefix_index = rows[0, :P]  # [P] slots every decoding request shares
        self.kv_index = rows[:, P:max_len]  # [B, S] own slots (padding entries are masked out)
        own = torch.tensor(seq_lens, device=rows.device) - P
        arange = torch.arange(max_len - P, device=rows.device)
        self.mask = (arange[None, :] < own[:, None])[:, None, None, :]  # [B, 1, 1, S]

    @staticmethod
    def _shared_prefix_len(rows: torch.Tensor, seq_lens: List[int]) -> int:
        """Length of the KV prefix that every request of a decode batch reads from the same
        slots (the radix cache makes this common: a shared system prompt or document).
        Only long shared prefixes in big batches are worth the cascade path."""
        if len(seq_lens) < CASCADE_MIN_BATCH or min(seq_lens) <= CASCADE_MIN_SHARED:
            return 0
        head = rows[:, : min(seq_lens) - 1]  # each request's newest token is its own
        same = (head == head[:1]).all(dim=0)  # [min_len - 1]
        shared = int(same.to(torch.int32).cumprod(0).sum())
        return shared if shared >= CASCADE_MIN_SHARED else 0

    def forward(self, q, k, v, layer_id: int, fb: ForwardBatch) -> torch.Tensor:
        # q [T, H, D]; k, v [T, KV, D]
        self.kv_pool.set_kv(layer_id, fb.out_cache_loc, k, v)
        k_cache, v_cache = self.kv_pool.k[layer_id], self.kv_pool.v[layer_id]  # [slots, KV, D]
        if self.all_decode:
            return self._decode_any(q, k_cache, v_cache)
        T, H, D = q.shape
        out = self._extend(q, k_cache, v_cache)  # [T, H, D]; decode rows filled below
        if self.decode_tokens.numel():
            out[self.decode_tokens] = self._decode_any(q[self.decode_tokens], k_cache, v_cache).view(-1, H, D)
        return out.view(T, H * D)

    def _decode_any(self, q, k_cache, v_cache) -> torch.Tensor:
        if self.shared:
            return self._decode_cascade(q, k_cache, v_cache)
        return self._decode(q, k_cache, v_cache)

    def _decode(self, q, k_cache, v_cache) -> torch.Tensor:
        B, H, D = q.shape
        KV = self.num_kv_heads
        S = self.kv_index.shape[1]
        # index_select copies whole rows (advanced indexing is ~10x slower on the CPU), into
        # buffers reused across layers and steps: a fresh tens-of-MB tensor per layer costs
        # more in page faults than the copy itself.
        flat = self.kv_index.reshape(-1)
        kbuf, vbuf = self._gather_buffers(flat.numel(), k_cache)
        keys = torch.index_select(k_cache, 0, flat, out=kbuf).view(B, S, KV, D).transpose(1, 2)  # [B, KV, S, D]
        values = torch.index_select(v_cache, 0, flat, out=vbuf).view(B, S, KV, D).transpose(1, 2)
        q = q.view(B, KV, H // KV, D).to(keys.dtype)  # [B, KV, group, D]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=self.mask, scale=self.scaling)
        return out.reshape(B, H * D).to(q.dtype)  # [B, H*D]

    def _decode_cascade(self, q, k_cache, v_cache) -> torch.Tensor:
        """Decode attention split in two: the batch's shared prefix is read once for all
        queries, each request's own tail separately; the two softmax parts are merged
        exactly (common max, summed denominators)."""
        B, H, D = q.shape
        KV = self.num_kv_heads
        S = self.kv_index.shape[1]
        qf = q.view(B, KV, H // KV, D).float() * self.scaling  # [B, KV, G, D]
        kp = k_cache.index_select(0, self.prefix_index).float()  # [P, KV, D]
        vp = v_cache.index_select(0, self.prefix_index).float()  # [P, KV, D]
        flat = self.kv_index.reshape(-1)
        ks = k_cache.index_select(0, flat).view(B, S, KV, D).float()  # [B, S, KV, D]
        vs = v_cache.index_select(0, flat).view(B, S, KV, D).float()
        sp = torch.einsum("bkgd,pkd->bkgp", qf, kp)  # [B, KV, G, P]
        ss = torch.einsum("bkgd,bskd->bkgs", qf, ks).masked_fill_(~self.mask, float("-inf"))  # [B, KV, G, S]
        m = torch.maximum(sp.amax(-1), ss.amax(-1))[..., None]  # [B, KV, G, 1]
        ep, es = torch.exp(sp - m), torch.exp(ss - m)
        out = torch.einsum("bkgp,pkd->bkgd", ep, vp) + torch.einsum("bkgs,bskd->bkgd", es, vs)
        out = out / (ep.sum(-1, keepdim=True) + es.sum(-1, keepdim=True))
        return out.reshape(B, H * D).to(q.dtype)  # [B, H*D]

    def _gather_buffers(self, rows: int, like: torch.Tensor):
        buf = getattr(self, "_buf", None)
        if buf is None or buf.shape[1] < rows or buf.dtype != like.dtype or buf.device != like.device:
            buf = torch.empty((2, max(rows, 1024)) + tuple(like.shape[1:]), dtype=like.dtype, device=like.device)
            self._buf = buf
        return buf[0, :rows], buf[1, :rows]

    def _extend(self, q, k_cache, v_cache) -> torch.Tensor:
        T, H, D = q.shape
        out = torch.empty(T, H, D, dtype=q.dtype, device=q.device)
        for index, mask, start, e in self.extends:
            qi = q[start:start + e].transpose(0, 1)  # [H, e, D]
            keys = k_cache.index_select(0, index).transpose(0, 1)  # [KV, s, D]
            values = v_cache.index_select(0, index).transpose(0, 1)  # [KV, s, D]
            oi = F.scaled_dot_product_attention(
                qi, keys, values, attn_mask=mask, is_causal=mask is None,
                scale=self.scaling, enable_gqa=H != self.num_kv_heads,
            )  # [H, e, D]
            out[start:start + e] = oi.transpose(0, 1)
        return out
