"""The fused quantized decode layer (model_executor/llama_layer.c): two C calls per layer give
the layer-by-layer path's logits BIT FOR BIT and its greedy tokens, for every quantized format
on lmprog's C kernels (int4 / int8 weights x int8 activations on each qdot.c build, x float32
activations on qgemm.c), batches 1..8, with and without the cascade (shared-prefix) decode,
and with q/k/v biases (Qwen2). Steps at or above `dense_rows`, float32 models and a switched-off
fused path run layer by layer."""

from __future__ import annotations

import pytest
import torch

from lmprog_runtime.attention import torch_native as tn
from lmprog_runtime.config import ServerArgs
from lmprog_runtime.model_executor import fused_ops, llama_layer, probe, qgemm
from lmprog_runtime.model_executor.runner import ModelRunner
from test_model import HandBatcher

pytestmark = pytest.mark.skipif(not (qgemm.available() and llama_layer.available()),
                                reason="no C compiler: the fused layer is not built")


def _runner(path, fmt: str, act: str, monkeypatch, dense_rows_at: int = 10 ** 9,
            kv_cache_dtype: str = "auto") -> ModelRunner:
    """A runner whose probe 'measured' (fmt, act) fastest below `dense_rows_at` rows."""
    def timings(config, formats):
        fast = lambda f, b: f[0] != "none" and f[1] == act and b < dense_rows_at  # noqa: E731
        return {f: {b: (0.4 if fast(f, b) else (1.0 if f[0] == "none" else 3.0)) * b for b in probe.PROBE_BATCHES}
                for f in formats}

    monkeypatch.setattr(probe, "measure_cached", timings)
    runner = ModelRunner(ServerArgs(model_path=path, quantization=fmt, max_total_tokens=2048,
                                    max_running_requests=8, dtype="float32", kv_cache_dtype=kv_cache_dtype))
    assert runner.formats.quant == fmt and runner.formats.act_dtype == getattr(torch, act)
    return runner


def _decode(runner, prompts, steps: int, shared: int = 0):
    """Greedy: prefill, then `steps` decode steps -> (tokens per prompt, the prefill's and every
    decode step's logits).
    shared > 0: every request's first `shared` positions are the first request's KV slots
    (a common cached prefix the cascade reads once; prompts[i][:shared] equal)."""
    hb = HandBatcher(runner)
    rows = list(range(1, len(prompts) + 1))
    if shared:
        runner.forward(hb.batch([(1, 0, prompts[0][:shared])]))
        table = runner.req_to_token_pool.table
        for r in rows[1:]:
            table[r, :shared] = table[1, :shared]
        logits = runner.forward(hb.batch([(r, shared, p[shared:]) for r, p in zip(rows, prompts)]))
    else:
        logits = runner.forward(hb.batch([(r, 0, p) for r, p in zip(rows, prompts)]))
    outs, seen = [[] for _ in prompts], [logits.clone()]  # the prefill's (an extend) too
    for _ in range(steps):
        for out, tok in zip(outs, logits.argmax(-1).tolist()):
            out.append(tok)
        lens = [len(p) + len(o) - 1 for p, o in zip(prompts, outs)]
        logits = runner.forward(hb.batch([(r, n, [o[-1]]) for r, n, o in zip(rows, lens, outs)]))
        seen.append(logits.clone())
    return outs, seen


def _prompts(batch: int, shared: int = 0):
    g = torch.Generator().manual_seed(batch)
    head = torch.randint(3, 1000, (shared,), generator=g).tolist()
    return [head + torch.randint(3, 1000, (3 + i % 4,), generator=g).tolist() for i in range(batch)]


def _count_fused(monkeypatch) -> list:
    calls = []
    run = llama_layer.FusedLayers.run

    def counted(self, x, *args):
        calls.append(x.shape[0])
        return run(self, x, *args)

    monkeypatch.setattr(llama_layer.FusedLayers, "run", counted)
    return calls


def _assert_paths_equal(runner, monkeypatch, batches=(1, 2, 5, 8), steps=3, shared=0):
    calls = _count_fused(monkeypatch)
    for batch in batches:
        prompts = _prompts(batch, shared)
        monkeypatch.setattr(llama_layer, "enabled", False)
        want, want_logits = _decode(runner, prompts, steps, shared)
        assert not calls
        monkeypatch.setattr(llama_layer, "enabled", True)
        got, got_logits = _decode(runner, prompts, steps, shared)
        assert calls.count(batch) == steps and len(calls) == steps + 1 + bool(shared), (batch, calls)  # all fused
        calls.clear()
        assert got == want, batch
        for a, b in zip(got_logits, want_logits):
            assert torch.equal(a, b), (batch, (a - b).abs().max())


@pytest.mark.parametrize("fmt", ["int4", "int8"])
@pytest.mark.parametrize("variant", ["native", "avx2", "portable"])
def test_fused_equals_layer_by_layer_int8_activations(tiny_model_path, fmt, variant, monkeypatch):
    monkeypatch.setitem(qgemm._DOT, "native", qgemm._DOT[variant])  # both paths get this build
    monkeypatch.setattr(qgemm, "_C_FNS", {})
    runner = _runner(tiny_model_path, fmt, "int8", monkeypatch)
    assert qgemm.dot_isa("native") == qgemm.dot_isa(variant)
    _assert_paths_equal(runner, monkeypatch)


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_fused_equals_layer_by_layer_float_activations(tiny_model_path, fmt, monkeypatch):
    runner = _runner(tiny_model_path, fmt, "float32", monkeypatch)
    assert all(m._c_kernel == fmt for m in runner.model.layers.modules() if hasattr(m, "_c_kernel"))
    _assert_paths_equal(runner, monkeypatch)


def test_fused_equals_layer_by_layer_with_a_bfloat16_kv_cache(tiny_model_path, monkeypatch):
    """--kv-cache-dtype bf16: the fused step writes (rope_kv, rounded) and reads (the paged
    kernel, widened) a bfloat16 pool, with the layer-by-layer path's bits."""
    runner = _runner(tiny_model_path, "int4", "int8", monkeypatch, kv_cache_dtype="bf16")
    assert runner.token_to_kv_pool.k.dtype == torch.bfloat16
    _assert_paths_equal(runner, monkeypatch, batches=(1, 5))


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_fused_equals_layer_by_layer_with_cascade(tiny_model_path, fmt, monkeypatch):
    monkeypatch.setattr(tn, "CASCADE_MIN_BATCH", 2)
    monkeypatch.setattr(tn, "CASCADE_MIN_SHARED", 16)
    runner = _runner(tiny_model_path, fmt, "int8", monkeypatch)
    _assert_paths_equal(runner, monkeypatch, batches=(2, 6), shared=40)


def test_fused_equals_layer_by_layer_with_qkv_bias(tmp_path, monkeypatch):
    from tiny_model import make_tiny_llama

    runner = _runner(make_tiny_llama(tmp_path / "qwen2", model_type="qwen2"), "int4", "int8", monkeypatch)
    assert runner.model.layers[0].self_attn.qkv_proj.bias is not None
    _assert_paths_equal(runner, monkeypatch, batches=(1, 4))


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bf16"])
def test_whole_step_in_one_c_call_equals_the_per_layer_calls(tiny_model_path, kv_cache_dtype, monkeypatch):
    """A decode step whose attention is the paged kernel runs every layer from C (lm_layers_run),
    and its last norm and logits head too (every row wants logits): the same calls in the same
    order as the per-layer loop and the model's norm and head, so the same logits bit for bit."""
    runner = _runner(tiny_model_path, "int4", "int8", monkeypatch, kv_cache_dtype=kv_cache_dtype)
    prompts = _prompts(3)
    monkeypatch.setattr(llama_layer, "WHOLE_STEP", False)
    want, want_logits = _decode(runner, prompts, 3)
    fused = runner.model._fused_layers
    whole = []
    run_all = fused.run_all

    def counted(*args):
        whole.append(args[2])
        return run_all(*args)

    monkeypatch.setattr(fused, "run_all", counted)
    monkeypatch.setattr(llama_layer, "WHOLE_STEP", True)
    got, got_logits = _decode(runner, prompts, 3)
    assert whole and all(n == len(runner.model.layers) for n in whole)  # every decode step, all layers
    assert fused.final_of is not None and fused.final_of[1] is runner.model.quant_head and fused.final_of[3]
    assert got == want
    for a, b in zip(got_logits, want_logits):
        assert torch.equal(a, b), (a - b).abs().max()


def test_hicache_load_gate_is_waited_before_each_layers_kv_write(tiny_model_path, monkeypatch):
    """HiCache's layer-wise load-backs: layer i's KV slots are written only after wait(i)."""
    runner = _runner(tiny_model_path, "int4", "int8", monkeypatch)
    hb, pool = HandBatcher(runner), runner.attn_backend.kv_pool
    runner.forward(hb.batch([(1, 0, [5, 6, 7])]))
    fb = hb.batch([(1, 3, [8])])
    slot = int(fb.out_cache_loc[0])
    pool.k[:, slot] = float("nan")
    waited = []

    class Gate:
        def wait(self, layer):
            assert torch.isnan(pool.k[layer, slot]).all(), layer  # not written yet
            waited.append(layer)

    calls = _count_fused(monkeypatch)
    monkeypatch.setattr(pool, "load_gate", Gate())
    runner.forward(fb)
    assert calls == [1] and waited == list(range(len(runner.model.layers)))
    assert not torch.isnan(pool.k[:, slot]).any()


def test_replaced_modules_and_buffers_rebind(tiny_model_path, monkeypatch):
    """A projection swapped for another QuantLinear (or its buffers for new objects) is what the
    fused step then uses; one swapped for a dense Linear makes the model run layer by layer."""
    from lmprog_runtime.model_executor.quant import QuantLinear

    runner = _runner(tiny_model_path, "int8", "int8", monkeypatch)
    _assert_paths_equal(runner, monkeypatch, batches=(2,), steps=1)
    mlp, attn = runner.model.layers[1].mlp, runner.model.layers[0].self_attn
    before = _decode(runner, _prompts(2), 1)[1]
    old = mlp.down_proj
    swapped = QuantLinear("int8", old.out_features, old.in_features, torch.int8)
    swapped.set_weight(torch.randn(old.out_features, old.in_features) * 0.05)
    mlp.down_proj = swapped
    attn.o_proj.scales = attn.o_proj.scales * 1.5  # a new buffer object in the same module
    _assert_paths_equal(runner, monkeypatch, batches=(2,), steps=1)
    assert not torch.equal(_decode(runner, _prompts(2), 1)[1][-1], before[-1])
    mlp.down_proj = torch.nn.Linear(old.in_features, old.out_features, bias=False)
    calls = _count_fused(monkeypatch)
    _decode(runner, _prompts(2), 1)
    assert calls == [] and runner.model._fused_layers is False


def test_binding_check_reads_the_model_only_after_a_registration(tiny_model_path, monkeypatch):
    """Steps register nothing, so `bound` skips its ~630 identity tests; any registration (here a
    module made elsewhere) makes the next step run them; a KV pool re-allocated (release_memory /
    resume_memory: no registration) rebinds by the pool's own tensors."""
    runner = _runner(tiny_model_path, "int8", "int8", monkeypatch)
    prompts = _prompts(2)
    before = _decode(runner, prompts, 2)[0]
    fused, count = runner.model._fused_layers, llama_layer._registrations[0]
    assert fused.checked == count
    full = []
    monkeypatch.setattr(llama_layer.operator, "getitem", lambda d, k: full.append(k) or d[k])
    assert _decode(runner, prompts, 2)[0] == before and full == []
    assert llama_layer._registrations[0] == count  # a step registers nothing
    torch.nn.Linear(2, 2)
    assert _decode(runner, prompts, 1)[0] == [o[:1] for o in before] and len(full) == len(fused.keys)
    runner.release_memory(weights=False, kv_cache=True)
    runner.resume_memory(weights=False, kv_cache=True)
    assert _decode(runner, prompts, 2)[0] == before
    pool = runner.token_to_kv_pool
    assert [s.k_cache for s in fused.structs] == [pool.k[i].data_ptr() for i in range(len(fused.structs))]


@pytest.mark.parametrize("whole", [True, False])
def test_a_step_with_an_index_out_of_range_raises_before_writing(tiny_model_path, whole, monkeypatch):
    """The fused step's rope_kv checks positions and slots (no torch reductions before the step):
    a slot past the pool or a position past the rope table is an IndexError, nothing written."""
    runner = _runner(tiny_model_path, "int4", "int8", monkeypatch)
    monkeypatch.setattr(llama_layer, "WHOLE_STEP", whole)
    hb, pool = HandBatcher(runner), runner.token_to_kv_pool
    runner.forward(hb.batch([(1, 0, [5, 6, 7])]))
    before = pool.k.clone()
    fb = hb.batch([(1, 3, [8])])
    fb.out_cache_loc = torch.tensor([pool.k.shape[1]])
    calls = _count_fused(monkeypatch)
    with pytest.raises(IndexError):
        runner.forward(fb)
    fb = hb.batch([(1, 3, [8])])
    fb.positions = torch.tensor([runner.model.rope_table.shape[0]])
    with pytest.raises(IndexError):
        runner.forward(fb)
    assert calls == [1, 1] and torch.equal(pool.k, before)


def test_steps_at_dense_rows_run_layer_by_layer(tiny_model_path, monkeypatch):
    runner = _runner(tiny_model_path, "int8", "int8", monkeypatch, dense_rows_at=4)
    assert runner.formats.dense_rows == 4
    calls = _count_fused(monkeypatch)
    _decode(runner, _prompts(3), 2)
    assert calls == [3, 3]
    calls.clear()
    _decode(runner, _prompts(5), 2)  # 5 rows >= dense_rows: the dense copies, layer by layer
    assert calls == []
    runner = _runner(tiny_model_path, "int8", "int8", monkeypatch)  # no dense copies: MAX_ROWS bounds
    assert runner.formats.dense_rows is None
    hb = HandBatcher(runner)
    runner.forward(hb.batch([(1, 0, list(range(3, 3 + llama_layer.MAX_ROWS)))]))
    runner.forward(hb.batch([(2, 0, list(range(3, 4 + llama_layer.MAX_ROWS)))]))
    assert calls == [llama_layer.MAX_ROWS]


def test_float32_models_and_the_switch_keep_the_layer_by_layer_path(tiny_model_path, monkeypatch):
    calls = _count_fused(monkeypatch)
    dense = ModelRunner(ServerArgs(model_path=tiny_model_path, quantization="none", max_total_tokens=1024,
                                   max_running_requests=4, dtype="float32"))
    _decode(dense, _prompts(2), 2)
    assert calls == [] and dense.model._fused_layers is False
    runner = _runner(tiny_model_path, "int4", "int8", monkeypatch)
    monkeypatch.setattr(llama_layer, "enabled", False)
    _decode(runner, _prompts(2), 2)
    assert calls == []


def test_silu_mul_matches_torch_to_float_rounding():
    g = torch.Generator().manual_seed(0)
    gu = torch.randn(5, 2 * 83, generator=g) * 8  # I = 83: a tail after the 16-lane blocks
    gu[0, :4] = torch.tensor([0.0, -200.0, 200.0, 1e-30])
    gu[1, 0] = float("nan")
    got = fused_ops.silu_mul(gu)
    want = torch.nn.functional.silu(gu[:, :83].double()) * gu[:, 83:].double()
    assert got.shape == (5, 83) and torch.isnan(got[1, 0]) and torch.isnan(want[1, 0])
    ok = ~torch.isnan(want)
    assert ((got.double() - want).abs()[ok] <= 1e-6 * want.abs()[ok] + 1e-30).all()
    assert torch.equal(fused_ops.silu_mul(gu[2:3].contiguous()), got[2:3])  # a row alone: the same bits
