"""The fused rope + KV write of decode_ops.c against the torch ops it replaces, and the whole
model with it against the model without it (the oracle), bit for bit: tiny model, several
batch sizes, prefill, decodes and short extends, with and without cached prefixes, page_size 1
and 16."""

from __future__ import annotations

import pytest
import torch

from bench.one_batch import Batches
from lmprog_runtime.config import ServerArgs
from lmprog_runtime.model_executor import decode_ops
from lmprog_runtime.model_executor.runner import ModelRunner
from lmprog_runtime.models.llama import apply_rope

pytestmark = pytest.mark.skipif(not decode_ops.available(), reason="no C compiler: the model keeps torch's ops")


@pytest.mark.parametrize("T,H,KV,D", [(1, 9, 3, 64), (5, 4, 4, 16), (70, 8, 2, 32)])  # 70: threaded
def test_rope_kv_is_bit_identical_to_torch(T, H, KV, D):
    torch.manual_seed(T)
    table = torch.randn(256, 2, D)
    qkv = torch.randn(T, (H + 2 * KV) * D)
    pos = torch.randint(0, 256, (T,))
    slots = torch.randperm(300)[:T]
    k_cache, v_cache = torch.zeros(300, KV, D), torch.zeros(300, KV, D)
    q = decode_ops.rope_kv(qkv, H, KV, table, pos, slots, k_cache, v_cache)
    cs = table[pos]
    qk = apply_rope(qkv[:, :(H + KV) * D].view(T, H + KV, D), cs[:, 0:1], cs[:, 1:2])
    assert torch.equal(q, qk[:, :H])
    assert torch.equal(k_cache[slots], qk[:, H:])
    assert torch.equal(v_cache[slots], qkv[:, (H + KV) * D:].view(T, KV, D))
    untouched = torch.ones(300, dtype=torch.bool)
    untouched[slots] = False
    assert not k_cache[untouched].any() and not v_cache[untouched].any()


def test_rope_kv_refuses_an_index_out_of_range_and_writes_nothing():
    T, H, KV, D = 3, 2, 1, 16
    table, qkv = torch.randn(8, 2, D), torch.randn(T, (H + 2 * KV) * D)
    k_cache, v_cache = torch.zeros(10, KV, D), torch.zeros(10, KV, D)
    for pos, slots in (([0, 8, 1], [0, 1, 2]), ([0, -1, 1], [0, 1, 2]), ([0, 1, 2], [0, 10, 2]),
                       ([0, 1, 2], [-3, 1, 2])):
        with pytest.raises(IndexError):
            decode_ops.rope_kv(qkv, H, KV, table, torch.tensor(pos), torch.tensor(slots), k_cache, v_cache)
        assert not k_cache.any() and not v_cache.any()
    decode_ops.rope_kv(qkv, H, KV, table, torch.tensor([0, 7, 1]), torch.tensor([0, 9, 2]), k_cache, v_cache)
    assert k_cache[9].any()


def test_rope_kv_writes_a_bfloat16_cache_rounded_as_torch_rounds():
    """--kv-cache-dtype bf16: K (after rope) and V rounded to nearest even, NaN and infinities
    kept, as `.to(torch.bfloat16)` does; the queries stay float32."""
    torch.manual_seed(3)
    T, H, KV, D = 6, 4, 2, 16
    table = torch.randn(64, 2, D)
    qkv = torch.randn(T, (H + 2 * KV) * D)
    v = qkv[:, (H + KV) * D:]
    # ties (low half exactly 0x8000, even and odd upper halves), NaN, infinities, a subnormal
    v[0, :6] = torch.tensor([0x3F808000, 0x3F818000, 0x7FC00001, 0x7F800000, 0xFF800000, 0x00000001],
                            dtype=torch.int64).to(torch.int32).view(torch.float32)
    pos, slots = torch.randint(0, 64, (T,)), torch.randperm(50)[:T]
    k_cache = torch.zeros(50, KV, D, dtype=torch.bfloat16)
    v_cache = torch.zeros(50, KV, D, dtype=torch.bfloat16)
    q = decode_ops.rope_kv(qkv, H, KV, table, pos, slots, k_cache, v_cache)
    cs = table[pos]
    qk = apply_rope(qkv[:, :(H + KV) * D].view(T, H + KV, D), cs[:, 0:1], cs[:, 1:2])
    assert q.dtype == torch.float32 and torch.equal(q, qk[:, :H])
    assert torch.equal(k_cache[slots].view(torch.int16), qk[:, H:].to(torch.bfloat16).view(torch.int16))
    assert torch.equal(v_cache[slots].view(torch.int16), v.reshape(T, KV, D).to(torch.bfloat16).view(torch.int16))


@pytest.fixture(scope="module", params=[1, 16], ids=["page1", "page16"])
def runner(request, tiny_model_path):
    return ModelRunner(ServerArgs(model_path=tiny_model_path, dtype="float32", page_size=request.param,
                                  max_total_tokens=8 * 64 + 64, max_running_requests=8, context_length=256))


def _forward_both(runner, fb_fn):
    """Logits with the fused ops, then without (the oracle), on identical inputs and KV."""
    k0, v0 = runner.token_to_kv_pool.k.clone(), runner.token_to_kv_pool.v.clone()
    fused = runner.forward(fb_fn())
    k1, v1 = runner.token_to_kv_pool.k.clone(), runner.token_to_kv_pool.v.clone()
    runner.token_to_kv_pool.k.copy_(k0)
    runner.token_to_kv_pool.v.copy_(v0)
    decode_ops.enabled = False
    try:
        plain = runner.forward(fb_fn())
    finally:
        decode_ops.enabled = True
    assert torch.equal(k1, runner.token_to_kv_pool.k) and torch.equal(v1, runner.token_to_kv_pool.v)
    return fused, plain


@pytest.mark.parametrize("batch,cached,new", [(1, 0, 9), (1, 40, 1), (3, 17, 1), (8, 33, 1), (2, 20, 5)])
def test_model_with_fused_ops_matches_without(runner, batch, cached, new, monkeypatch):
    """The same K/V and the same logits, bit for bit (float32 greedy outputs cannot change)."""
    batches = Batches(runner, 64)
    torch.manual_seed(batch * 100 + cached)
    if cached:  # a real prefix in the KV cache, written by a plain prefill
        decode_ops.enabled = False
        try:
            runner.forward(batches.make(batch, 0, cached))
        finally:
            decode_ops.enabled = True
    fb = batches.make(batch, cached, new)
    calls, rope_kv = [], decode_ops.rope_kv
    monkeypatch.setattr(decode_ops, "rope_kv", lambda *a: calls.append(1) or rope_kv(*a))
    fused, plain = _forward_both(runner, lambda: fb)
    assert len(calls) == runner.model_config.num_layers  # the fused path ran, once per layer
    assert torch.equal(fused, plain)


@pytest.mark.parametrize("batch,cached,new", [(1, 40, 1), (3, 17, 1), (2, 20, 5)])
def test_bfloat16_kv_cache_fused_ops_match_without(tiny_model_path, batch, cached, new, monkeypatch):
    """--kv-cache-dtype bf16 on a float32 model: the C op's rounded K/V are the bits set_kv
    writes, and the logits are the same bit for bit."""
    runner = ModelRunner(ServerArgs(model_path=tiny_model_path, dtype="float32", kv_cache_dtype="bf16",
                                    max_total_tokens=8 * 64 + 64, max_running_requests=8, context_length=256))
    assert runner.token_to_kv_pool.k.dtype == torch.bfloat16 and runner.dtype == torch.float32
    test_model_with_fused_ops_matches_without(runner, batch, cached, new, monkeypatch)


def test_fused_kv_write_waits_for_layerwise_load_backs(runner, monkeypatch):
    """The C op writes the KV pool itself, so it must pass HiCache's layer gate as set_kv does:
    a layer-wise load-back in flight copies layer i before anything writes or reads it."""
    order = []

    class Gate:  # records the waits, in order with the C writes
        def wait(self, layer):
            order.append(("wait", layer))

    rope_kv = decode_ops.rope_kv
    monkeypatch.setattr(decode_ops, "rope_kv", lambda *a: order.append(("write",)) or rope_kv(*a))
    pool = runner.token_to_kv_pool
    monkeypatch.setattr(pool, "load_gate", Gate())
    runner.forward(Batches(runner, 64).make(2, 10, 1))
    writes = [i for i, e in enumerate(order) if e == ("write",)]
    assert len(writes) == runner.model_config.num_layers
    for layer, i in enumerate(writes):  # each layer's write comes right after its own wait
        assert order[i - 1] == ("wait", layer), order
