"""torch_native's cascade decode (a batch-wide shared KV prefix read once) equals the
plain padded decode path."""

import pytest
import torch

import lmprog_runtime.attention.torch_native as tn
from lmprog_runtime.cache.kv_pool import TokenToKVPool
from lmprog_runtime.model_executor.forward_batch import ForwardBatch


def _batch(shared, own_lens, kv_heads=3, head_dim=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    B = len(own_lens)
    total = shared + sum(own_lens) + 8
    pool = TokenToKVPool(total, 1, kv_heads, head_dim, dtype)
    pool.k.copy_(torch.randn(pool.k.shape, generator=g))
    pool.v.copy_(torch.randn(pool.v.shape, generator=g))
    slots = (torch.randperm(total, generator=g) + 1).tolist()
    prefix = [slots.pop() for _ in range(shared)]
    seq_lens = [shared + n for n in own_lens]
    table = torch.zeros(B + 1, max(seq_lens), dtype=torch.int64)
    for i, n in enumerate(own_lens):
        table[i + 1, :seq_lens[i]] = torch.tensor(prefix + [slots.pop() for _ in range(n)])
    fb = ForwardBatch(
        input_ids=torch.zeros(B, dtype=torch.int64), positions=torch.tensor([s - 1 for s in seq_lens]),
        out_cache_loc=table[torch.arange(1, B + 1), torch.tensor(seq_lens) - 1],
        req_pool_indices=torch.arange(1, B + 1), seq_lens=torch.tensor(seq_lens),
        extend_lens=torch.ones(B, dtype=torch.int64), req_to_token=table,
        seq_lens_cpu=seq_lens, extend_lens_cpu=[1] * B)
    return pool, fb, g


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("own_lens", [[1, 5, 9, 30], [3, 3, 3, 3, 3, 3]])
def test_cascade_equals_padded_decode(monkeypatch, dtype, tol, own_lens):
    heads, kv_heads, head_dim = 6, 3, 16
    outs = []
    for cascade in (True, False):
        monkeypatch.setattr(tn, "CASCADE_MIN_BATCH", 4 if cascade else 10 ** 9)
        pool, fb, g = _batch(300, own_lens, kv_heads, head_dim, dtype)
        backend = tn.TorchNativeAttnBackend(pool, heads, kv_heads, head_dim)
        backend.init_forward_metadata(fb)
        assert backend.shared == (300 if cascade else 0)
        q = torch.randn(len(own_lens), heads, head_dim, generator=g).to(dtype)
        k = torch.randn(len(own_lens), kv_heads, head_dim, generator=g).to(dtype)
        v = torch.randn(len(own_lens), kv_heads, head_dim, generator=g).to(dtype)
        outs.append(backend.forward(q, k, v, 0, fb).float())
    assert (outs[0] - outs[1]).abs().max().item() < tol


def test_short_or_unshared_prefix_takes_the_plain_path():
    pool, fb, _ = _batch(100, [2, 2, 2, 2])
    backend = tn.TorchNativeAttnBackend(pool, 6, 3, 16)
    backend.init_forward_metadata(fb)
    assert backend.shared == 0


@pytest.mark.parametrize("page_size", [1, 16])
def test_short_extends_batched_equal_per_request(monkeypatch, page_size):
    """Jump-forward-sized extends (a few tokens) attended as one padded batch equal the
    per-request causal path."""
    from paged_attention_cases import make_batch

    prefix_lens, extend_lens = [40, 7, 0, 90, 33], [3, 1, 5, 16, 40]
    outs = []
    for short in (16, 0):
        monkeypatch.setattr(tn, "SHORT_EXTEND", short)
        pool, _, fb, g = make_batch(prefix_lens, extend_lens, 2, 16, torch.float32, page_size, seed=1)
        backend = tn.TorchNativeAttnBackend(pool, 4, 2, 16)
        backend.init_forward_metadata(fb)
        q = torch.randn(fb.num_tokens, 4, 16, generator=g)
        k = torch.randn(fb.num_tokens, 2, 16, generator=g)
        v = torch.randn(fb.num_tokens, 2, 16, generator=g)
        outs.append(backend.forward(q, k, v, 0, fb))
    assert (outs[0] - outs[1]).abs().max().item() < 1e-5
