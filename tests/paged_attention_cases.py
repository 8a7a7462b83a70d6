"""Shared by the attention-backend tests (CPU interpreter and GPU): build a paged KV pool and a
ragged ForwardBatch by hand, run a backend and `torch_native` on identical copies, compare.

Importing this module imports no kernel library (the CPU tests set TRITON_INTERPRET first).
"""

from __future__ import annotations

import torch

from lmprog_runtime.attention import create_attention_backend
from lmprog_runtime.cache.kv_pool import TokenToKVPool
from lmprog_runtime.model_executor.forward_batch import ForwardBatch

LAYERS = 2


def make_batch(prefix_lens, extend_lens, kv_heads, head_dim, dtype, page_size, seed=0, device="cpu"):
    """Two identical KV pools (every slot random, so prefixes are "cached") and a ForwardBatch
    whose requests own shuffled pages in shuffled table rows; returns (pool_a, pool_b, fb, gen)."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    pages_per_req = [-(-s // page_size) for s in seq_lens]
    num_pages = sum(pages_per_req) + 3
    order = (torch.randperm(num_pages, generator=g) + 1).tolist()  # page 0 is padding
    table = torch.zeros(len(seq_lens) + 2, max(pages_per_req) * page_size, dtype=torch.int64)
    rows = torch.randperm(len(seq_lens), generator=g) + 1
    for i, n_pages in enumerate(pages_per_req):
        pages = torch.tensor([order.pop() for _ in range(n_pages)])
        table[rows[i], :n_pages * page_size] = (pages[:, None] * page_size + torch.arange(page_size)).reshape(-1)
    pools = [TokenToKVPool(num_pages * page_size, LAYERS, kv_heads, head_dim, dtype, device, page_size)
             for _ in range(2)]
    k, v = torch.randn(pools[0].k.shape, generator=g), torch.randn(pools[0].v.shape, generator=g)
    for pool in pools:
        pool.k.copy_(k)
        pool.v.copy_(v)
    out_loc = torch.cat([table[r, p:p + e] for r, p, e in zip(rows, prefix_lens, extend_lens)])
    positions = torch.cat([torch.arange(p, p + e) for p, e in zip(prefix_lens, extend_lens)])
    fb = ForwardBatch(
        input_ids=torch.zeros(len(out_loc), dtype=torch.int64, device=device), positions=positions.to(device),
        out_cache_loc=out_loc.to(device), req_pool_indices=rows.to(device),
        seq_lens=torch.tensor(seq_lens, device=device), extend_lens=torch.tensor(extend_lens, device=device),
        req_to_token=table.to(device), seq_lens_cpu=seq_lens, extend_lens_cpu=list(extend_lens))
    return pools[0], pools[1], fb, g


def compare_to_torch_native(backend, prefix_lens, extend_lens, heads, kv_heads, head_dim, dtype, page_size,
                            seed=0, device="cpu", check=None, tree_masks=None, **backend_kwargs) -> float:
    """Max abs diff of `backend`'s output vs torch_native's over LAYERS layers of one batch;
    also asserts both wrote the same KV. `check(backend_obj)` runs after init_forward_metadata.
    `tree_masks`: ForwardBatch.tree_masks (draft trees) for the batch."""
    pool_ref, pool_new, fb, g = make_batch(prefix_lens, extend_lens, kv_heads, head_dim, dtype, page_size,
                                           seed, device)
    fb.tree_masks = tree_masks
    kw = dict(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim)
    ref = create_attention_backend("torch_native", token_to_kv_pool=pool_ref, **kw)
    new = create_attention_backend(backend, token_to_kv_pool=pool_new, **kw, **backend_kwargs)
    ref.init_forward_metadata(fb)
    new.init_forward_metadata(fb)
    if check is not None:
        check(new)
    worst, T = 0.0, fb.num_tokens
    for layer in range(LAYERS):
        q = torch.randn(T, heads, head_dim, generator=g).to(device=device, dtype=dtype)
        k = torch.randn(T, kv_heads, head_dim, generator=g).to(device=device, dtype=dtype)
        v = torch.randn(T, kv_heads, head_dim, generator=g).to(device=device, dtype=dtype)
        expected = ref.forward(q, k, v, layer, fb).float()
        got = new.forward(q, k, v, layer, fb)
        assert got.shape == (T, heads * head_dim) and got.dtype == dtype, (got.shape, got.dtype)
        assert torch.isfinite(got.float()).all()
        worst = max(worst, (got.float() - expected).abs().max().item())
    assert torch.equal(pool_ref.k, pool_new.k) and torch.equal(pool_ref.v, pool_new.v)
    print(f"\n{backend} {str(dtype)[6:]} prefix={list(prefix_lens)} extend={list(extend_lens)} "
          f"heads={heads}/{kv_heads} d={head_dim} page={page_size}: max|diff| = {worst:.2e}")
    return worst
