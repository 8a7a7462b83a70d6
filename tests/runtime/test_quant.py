"""Weight-only quantization (model_executor/quant.py) and the format probe (model_executor/probe.py).

Tolerances, stated once:
- a QuantLinear with float32 kernels equals x @ dequant(W).T to float32 rounding (1e-4 rel.);
  with bfloat16 kernels the input is rounded to 8 bits of mantissa: |err| <= 2^-7 * |x| |w| sums.
- GGUF Q4_0/Q4_1 blocks convert to int4 exactly (dequantized equal to gguf's own dequantize).
- a quantized model's logits against its float32 self (tiny model): int4 within 0.15, int8 within
  0.05 absolute on logits of magnitude ~1-3, and the same top-1 token for >= 90% of positions.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lmprog_runtime.config import ServerArgs
from lmprog_runtime.model_executor import probe, qgemm
from lmprog_runtime.model_executor.quant import (
    INT4_GROUP, QuantLinear, dequantize_int4, gguf_q4_blocks, quantize_int4, quantize_int8,
)
from lmprog_runtime.model_executor.runner import ModelRunner


def test_quantizers_error_bounds():
    torch.manual_seed(0)
    w = torch.randn(64, 128)
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and (w - q.float() * scale[:, None]).abs().max() <= scale.max() / 2 + 1e-6
    blocks = quantize_int4(w)
    err = (w - dequantize_int4(blocks)).abs().reshape(64, -1, INT4_GROUP)
    assert blocks[0].min() >= 0 and blocks[0].max() <= 15
    assert (err <= blocks[1][..., None] / 2 + 1e-6).all()


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
def test_quant_linear_matches_its_dequantized_weight(fmt, act):
    torch.manual_seed(1)
    n, k = 96, 128
    w, bias, x = torch.randn(n, k) * 0.05, torch.randn(n), torch.randn(5, k)
    lin = QuantLinear(fmt, n, k, act, bias=True)
    lin.set_weight(w)
    lin.bias.copy_(bias)
    if fmt == "int8":
        deq = lin.qweight.float() * lin.scales.float()[:, None]
    else:  # the kernel's grid: scales and zeros as stored, in act's precision
        q, scale, zero = quantize_int4(w)
        deq = dequantize_int4((q, scale.to(act).float(), zero.to(act).float()))
    ref_x = x.to(act).float()
    sums = (ref_x.abs() @ deq.abs().t()).max()
    tol = 1e-4 * sums if act == torch.float32 else 2 ** -7 * sums  # bf16: input and output rounding
    y = lin(x)
    assert y.dtype == torch.float32 and y.shape == (5, n)
    assert (y - (ref_x @ deq.t() + bias)).abs().max() <= tol


@pytest.mark.parametrize("rows", [1, 3, 9])
def test_native_int8_kernel_matches_torch_int8_kernel(rows, monkeypatch):
    """qgemm.c (float32 activations) against torch's int8 kernel on the same int8 weights,
    with an output count that leaves a tail of rows (97 = 24 blocks of 4 + 1)."""
    if not qgemm.available():
        pytest.skip("no C compiler: QuantLinear keeps torch's int8 kernel")
    torch.manual_seed(3)
    w, x = torch.randn(97, 160) * 0.05, torch.randn(rows, 160)
    lin = QuantLinear("int8", 97, 160, torch.float32)
    lin.set_weight(w)
    native = lin(x)
    monkeypatch.setattr(qgemm, "enabled", False)  # a layer built now takes torch's kernel
    torch_lin = QuantLinear("int8", 97, 160, torch.float32)
    torch_lin.set_weight(w)
    assert torch_lin._c_kernel is None and lin._c_kernel == "int8"
    reference = torch_lin(x)
    torch.testing.assert_close(native, reference, rtol=1e-4, atol=1e-5)


def test_dense_rows_switch_to_the_kept_dense_weight():
    """At dense_rows rows the layer multiplies by its dequantized weight: the same model as its
    kernel below that (not the original `w`), with only the rounding order changed."""
    torch.manual_seed(2)
    w, x = torch.randn(32, 64), torch.randn(8, 64)
    lin = QuantLinear("int4", 32, 64, torch.float32, dense_rows=8)
    lin.set_weight(w)
    deq = dequantize_int4(quantize_int4(w))
    torch.testing.assert_close(lin(x), x @ deq.t())  # 8 rows: the dense copy
    assert not torch.allclose(lin(x), x @ w.t(), rtol=0, atol=1e-3)  # ... of the 4-bit weight
    torch.testing.assert_close(lin(x[:7]), (x @ deq.t())[:7], rtol=1e-4, atol=1e-4)  # 7 rows: kernel


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.skipif(not qgemm.dot_available(), reason="qdot.c (int8 activations) is not built here")
def test_dense_copy_is_the_int8_kernels_weight(fmt):
    """qdot.c's weights interleave rows in groups of 8: the dense copy is still the weight each
    row's kernel computes with (it was once read in the interleaved order: another model)."""
    torch.manual_seed(3)
    w, x = torch.randn(40, 64) * 0.1, torch.randn(3, 64)
    lin = QuantLinear(fmt, 40, 64, torch.int8, dense_rows=2)
    lin.set_weight(w)
    kernel = lin(x[:1])  # 1 row: the kernel (int8 activations: ~1% of a row's scale)
    dense = lin(x)[:1]  # 3 rows: the dense copy
    assert ((kernel - dense).abs() <= 0.02 * (x[:1].abs() @ w.abs().t()) + 1e-3).all(), (kernel - dense).abs().max()


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
def test_dense_copy_is_the_kernels_weight(fmt, act):
    """The dense path and the kernel compute with one weight: they differ by accumulation order
    (float32 kernels) or by the kernel's bfloat16 input rounding (2^-8 relative per term)."""
    torch.manual_seed(3)
    w, x = torch.randn(64, 128) * 0.1, torch.randn(40, 128)
    dense = QuantLinear(fmt, 64, 128, act, dense_rows=1)
    kernel = QuantLinear(fmt, 64, 128, act)
    dense.set_weight(w)
    kernel.set_weight(w)
    a, b = dense(x), kernel(x)
    bound = (x.abs() @ w.abs().t()) * (2.0 ** -8 if act == torch.bfloat16 else 1e-6) + 1e-5
    assert ((a - b).abs() <= bound).all(), (a - b).abs().max()


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
def test_quant_kernels_are_batch_invariant(fmt, act):
    """Each row's result does not depend on the other rows: what --enable-deterministic-inference
    relies on (the dense float32 GEMM does not promise this: it differs by ~1e-6 between 1 and 40 rows)."""
    torch.manual_seed(4)
    lin = QuantLinear(fmt, 96, 128, act)
    lin.set_weight(torch.randn(96, 128))
    x = torch.randn(40, 128)
    full = lin(x)
    for rows in (1, 2, 7, 16, 33):
        assert torch.equal(lin(x[:rows]), full[:rows]), rows


def test_deterministic_inference_drops_the_dense_crossover(tiny_model_path, monkeypatch):
    monkeypatch.setattr(probe, "measure_cached", lambda config, formats: {
        f: {b: (1.0 if f[0] == "none" else 0.5 * b) for b in probe.PROBE_BATCHES} for f in formats})
    args = dict(model_path=tiny_model_path, max_total_tokens=1024, max_running_requests=4, quantization="int4")
    assert ModelRunner(ServerArgs(**args)).formats.dense_rows is not None
    runner = ModelRunner(ServerArgs(enable_deterministic_inference=True, **args))
    assert runner.quantization == "int4" and runner.formats.dense_rows is None
    assert runner.formats.act_dtype == torch.float32  # bf16 rounding would amplify attention's noise
    assert all(m.dense is None for m in runner.model.modules() if isinstance(m, QuantLinear))


@pytest.mark.parametrize("kind,head", [("Q4_0", 2), ("Q4_1", 4)])
def test_gguf_q4_blocks_are_exact(kind, head):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    rng = np.random.default_rng(0)
    rows, k = 3, 64
    raw = rng.integers(0, 256, size=(rows, k // 32 * (head + 16)), dtype=np.uint8)
    # sane fp16 scales/minimums: overwrite each block's header
    hdr = rng.normal(size=(rows, k // 32, head // 2)).astype(np.float16).view(np.uint8)
    raw.reshape(rows, k // 32, head + 16)[..., :head] = hdr.reshape(rows, k // 32, head)
    want = dequantize(raw, getattr(GGMLQuantizationType, kind)).reshape(rows, k)
    got = dequantize_int4(gguf_q4_blocks(raw, kind)).numpy()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


def test_choose_picks_fastest_batch1_and_the_crossover():
    t = {("none", "float32"): {1: 40, 4: 70, 16: 90, 64: 160},
         ("none", "bfloat16"): {1: 38, 4: 80, 16: 190, 64: 600},
         ("int8", "bfloat16"): {1: 22, 4: 30, 16: 92},  # stopped at 16: lost to dense there
         ("int4", "bfloat16"): {1: 15, 4: 23, 16: 80, 64: 300}}
    c = probe.choose(t)
    assert (c.quant, c.act_dtype, c.dense_dtype, c.dense_rows) == ("int4", torch.bfloat16, torch.float32, 64)
    slow = {("none", "float32"): {1: 10, 4: 20}, ("int8", "float32"): {1: 30, 4: 40}}
    assert probe.choose(slow).quant is None
    forced = probe.choose(slow, require_quant=True)
    assert forced.quant == "int8" and forced.dense_rows == 1
    near_tie = {("none", "float32"): {1: 40, 4: 70}, ("int8", "bfloat16"): {1: 39, 4: 60}}
    assert probe.choose(near_tie).quant is None  # within QUANT_MARGIN: timing noise, keep exact fp32


def test_choose_keeps_float32_activations_beside_float32_kernels():
    """A CPU with bfloat16 dot products: dense bfloat16 beats dense float32, but the winning
    kernels take float32 (int8 activations are quantized from float32), so the model runs in
    float32 and only the kept dense copies (the crossover's prefill GEMMs) are bfloat16."""
    t = {("none", "float32"): {1: 46, 4: 73, 16: 81, 64: 206},
         ("none", "bfloat16"): {1: 25, 4: 27, 16: 37, 64: 82},
         ("int4", "bfloat16"): {1: 9, 4: 13, 16: 38},
         ("int4", "int8"): {1: 5.8, 4: 8.5, 16: 26, 64: 110}}
    c = probe.choose(t)
    assert (c.quant, c.act_dtype, c.dense_dtype, c.dense_weight_dtype, c.dense_rows) == \
        ("int4", torch.int8, torch.float32, torch.bfloat16, 64)
    lin = torch.nn.Linear(64, 32, bias=False)
    q = QuantLinear("int8", 32, 64, torch.float32, dense_rows=4, dense_weight_dtype=torch.bfloat16)
    q.set_weight(lin.weight.data)
    assert q.dense.dtype == torch.bfloat16
    x = torch.randn(8, 64)
    y = q(x)  # 8 rows >= dense_rows: the bfloat16 copy, float32 in and out
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, x.bfloat16().float() @ q.dense.float().t(), rtol=1e-2, atol=1e-2)


def test_probe_times_only_finalists_past_batch_1():
    """After batch 1 only the dense formats and the quantized ones `choose` can pick (with and
    without require_quant) are timed further; choosing from the pruned timings gives the same
    answer as from the full ones."""
    full = {("none", "float32"): {1: 46, 4: 73, 16: 81, 64: 206},
            ("none", "bfloat16"): {1: 25, 4: 60, 16: 230, 64: 940},
            ("int4", "bfloat16"): {1: 15, 4: 19, 16: 66},
            ("int8", "bfloat16"): {1: 18, 4: 23, 16: 70},
            ("int8", "int8"): {1: 7.5, 4: 8.7, 16: 24, 64: 89},
            ("int4", "int8"): {1: 5.7, 4: 7.0, 16: 19, 64: 69}}
    first = {f: {1: t[1]} for f, t in full.items()}
    kept = probe.finalists(first)
    assert set(kept) == {("none", "float32"), ("none", "bfloat16"), ("int4", "int8")}
    pruned = {f: (t if f in kept else {1: t[1]}) for f, t in full.items()}
    for require_quant in (False, True):
        assert probe.choose(pruned, require_quant) == probe.choose(full, require_quant)
    dense_only = {("none", "float32"): {1: 10}, ("none", "bfloat16"): {1: 12}}
    assert set(probe.finalists(dense_only)) == set(dense_only)
    # a dense format dropped past DENSE_DROP x the best dense step: its later batches count as inf
    dropped = dict(pruned)
    dropped[("none", "bfloat16")] = {1: 25, 4: 60, 16: 230}
    assert probe.choose(dropped) == probe.choose(full)
    assert probe.DENSE_DROP_FROM > 1  # at batch 1 bfloat16 wins by reading half the bytes: never dropped there


def test_probe_consistency_check():
    quiet = {("none", "float32"): {1: 10, 4: 11, 16: 30}, ("int4", "bfloat16"): {1: 5, 4: 20}}
    busy = {("none", "float32"): {1: 10, 4: 90, 16: 30}, ("int4", "bfloat16"): {1: 5}}
    assert probe.consistent(quiet) and not probe.consistent(busy)


def test_auto_keeps_float32_for_unquantized_weights(tiny_model_path):
    runner = ModelRunner(ServerArgs(model_path=tiny_model_path, max_total_tokens=1024, max_running_requests=4))
    assert runner.quantization == "none"
    with pytest.raises(ValueError, match="quantization must be one of"):
        ServerArgs(quantization="int3")


def _teacher_forced_logits(runner, ids):
    from test_model import HandBatcher

    hb = HandBatcher(runner)
    return torch.cat([runner.forward(hb.batch([(1, i, [t])])) for i, t in enumerate(ids)])


@pytest.mark.parametrize("fmt,atol", [("int8", 0.05), ("int4", 0.15)])
def test_quantized_tiny_model_logits_near_float32(tiny_model_path, fmt, atol):
    args = dict(model_path=tiny_model_path, max_total_tokens=1024, max_running_requests=4, dtype="float32")
    ref = ModelRunner(ServerArgs(quantization="none", **args))
    runner = ModelRunner(ServerArgs(quantization=fmt, **args))
    assert runner.quantization == fmt and runner.dtype == torch.float32
    n_quant = sum(isinstance(m, QuantLinear) for m in runner.model.modules())
    assert n_quant == 2 * 4 + 1  # four projections per layer, and the head
    ids = ref.tokenizer("The quick brown fox jumps over the lazy dog, again and again.")["input_ids"]
    want, got = _teacher_forced_logits(ref, ids), _teacher_forced_logits(runner, ids)
    assert (got - want).abs().max() <= atol, (got - want).abs().max()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9


@pytest.mark.slow
def test_smollm2_int4_greedy_agreement():
    """The embedded GGUF: 4-bit layers straight from its Q4_1 blocks, int8 head, bf16 or fp32
    kernels as probed. Reported: tokens until the first difference from fp32 greedy, over eight
    prompts (a run diverges for good at the first near-tie it rounds apart: see
    test_qdot.py's twin)."""
    from test_model import greedy

    args = dict(max_total_tokens=4096, max_running_requests=8)
    ref = ModelRunner(ServerArgs(dtype="float32", quantization="none", **args))
    runner = ModelRunner(ServerArgs(quantization="int4", **args))
    tok = ref.tokenizer
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "The quick brown fox",
             "Water boils at", "import numpy as np", "The three primary colors are", "Dear Sir or Madam,"]
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    want, got = greedy(ref, prompts, 16), greedy(runner, prompts, 16)
    agree = [next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), len(w)) for g, w in zip(got, want)]
    print("int4 greedy tokens equal to fp32 before the first difference:", agree)
    assert sum(agree) >= 0.5 * 16 * len(prompts)
    ids = prompts[0] + want[0]
    lw, lg = _teacher_forced_logits(ref, ids), _teacher_forced_logits(runner, ids)
    assert (lg.argmax(-1) == lw.argmax(-1)).float().mean() >= 0.85
    assert (lg - lw).abs().max() <= 3.0  # logits span ~[-20, 40] here


# -- converted-weights cache ---------------------------------------------------------------------------
def test_weight_cache_round_trip_is_exact(tiny_model_path, tmp_path):
    from lmprog_runtime.model_executor import weight_cache
    args = dict(model_path=tiny_model_path, max_total_tokens=1024, max_running_requests=4, dtype="float32")
    runner = ModelRunner(ServerArgs(quantization="int4", **args))
    ids = runner.tokenizer("a cached model answers the same")["input_ids"]
    want = _teacher_forced_logits(runner, ids)
    path = str(tmp_path / "w.safetensors")
    weight_cache.save(runner.model, path)
    runner.model = weight_cache.load(lambda: runner._build_model(True), path)
    runner.model.attn_backend = runner.attn_backend
    assert sum(isinstance(m, QuantLinear) for m in runner.model.modules()) == 9
    torch.testing.assert_close(_teacher_forced_logits(runner, ids), want, rtol=0, atol=0)
    with open(path, "r+b") as fh:  # a truncated file is ignored, not half-loaded
        fh.truncate(100)
    assert weight_cache.load(lambda: runner._build_model(True), path) is None


@pytest.mark.slow
def test_gguf_warm_start_reads_cached_weights(tmp_path, monkeypatch):
    import lmprog_runtime.config as config

    monkeypatch.setattr(config, "CACHE_DIR", str(tmp_path))
    # a busy machine must not re-probe into another format between the two starts
    monkeypatch.setattr(probe, "consistent", lambda timings: True)
    args = ServerArgs(quantization="int4", max_total_tokens=1024, max_running_requests=4)
    cold = ModelRunner(args)
    ids = cold.tokenizer("The capital of France is")["input_ids"]
    want = _teacher_forced_logits(cold, ids)
    files = list(tmp_path.glob("gguf-*/weights-*.safetensors"))
    assert len(files) == 1
    warm = ModelRunner(args)
    assert warm.formats == cold.formats
    assert list(tmp_path.glob("gguf-*/weights-*.safetensors")) == files  # read, not converted again
    torch.testing.assert_close(_teacher_forced_logits(warm, ids), want, rtol=0, atol=0)


def test_select_formats_rules(tiny_model_path, tmp_path, monkeypatch):
    import lmprog_runtime.config as config
    from lmprog_runtime.model_executor.loader import load_model_config

    monkeypatch.setattr(config, "CACHE_DIR", str(tmp_path))
    cfg, cpu = load_model_config(tiny_model_path), torch.device("cpu")
    fp32 = probe.select_formats("float32", "auto", cpu, cfg, source_quantized=True)
    assert fp32.quant is None and fp32.dense_dtype == torch.float32  # an explicit fp32 stays fp32
    assert probe.select_formats("auto", "auto", cpu, cfg, source_quantized=False).quant is None
    forced = probe.select_formats("float32", "int8", cpu, cfg, source_quantized=False)
    assert forced.quant == "int8" and forced.dense_dtype == torch.float32
    assert list(tmp_path.glob("probe/formats-*.json"))  # the timings were cached
    with pytest.raises(ValueError, match="CPU only"):
        probe.select_formats("auto", "int4", torch.device("cuda"), cfg, source_quantized=True)


DETERMINISM_PROMPTS = ["the cat sat on the mat and the cat sat on the mat and the cat",
                       "one two three one two three one two three one two",
                       "hello", "a b c d e f g h i j k l m n o p q r s t u v w x y z a b c"]


def _greedy(engine, batched: bool):
    params = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    if batched:
        return [o["output_ids"] for o in engine.generate(DETERMINISM_PROMPTS, params)]
    return [engine.generate(p, params)["output_ids"] for p in DETERMINISM_PROMPTS]


def test_deterministic_int4_outputs_ignore_batch_speculation_and_cache(tiny_model_path):
    """int4 with --enable-deterministic-inference: greedy tokens are the same one at a time, batched,
    with NGRAM speculation (which verifies several rows per request) and from a warm cache."""
    from engine_helpers import make_engine

    runs = {}
    for spec in (False, True):
        kw = dict(speculative_algorithm="NGRAM") if spec else {}
        engine = make_engine(tiny_model_path, quantization="int4", enable_deterministic_inference=True,
                             max_total_tokens=4096, **kw)
        try:
            runs[spec, "sequential"] = _greedy(engine, batched=False)
            runs[spec, "warm cache, batched"] = _greedy(engine, batched=True)
            engine.check_integrity()
        finally:
            engine.shutdown()
    want = runs[False, "sequential"]
    for key, got in runs.items():
        assert got == want, key


@pytest.mark.skipif(not qgemm.available(), reason="lmprog's C kernels are not built here")
@pytest.mark.parametrize("kernel_act", ["float32", "int8"])
def test_verify_rows_run_the_kernels_their_decodes_run(tiny_model_path, monkeypatch, kernel_act):
    """A verify step (every row wants logits, more rows than requests) picks dense copy or
    kernel by its request count: past dense_rows rows it would take the dense copy while the
    decodes it replaces take the kernel, and their logits (so greedy tokens) would differ."""
    from lmprog_runtime.model_executor.forward_batch import ForwardBatch

    if kernel_act == "int8" and not qgemm.dot_available():
        pytest.skip("qdot.c (int8 activations) is not built here")
    monkeypatch.setattr(probe, "measure_cached", lambda config, formats: {  # kernel at 1-3 rows, dense from 4
        f: {b: (0.5 if f[1] == kernel_act else 1.0) * (b if f[0] != "none" or b < 4 else 1) for b in probe.PROBE_BATCHES}
        for f in formats})
    runner = ModelRunner(ServerArgs(model_path=tiny_model_path, max_total_tokens=1024, max_running_requests=4,
                                    quantization="int4", context_length=256))
    assert runner.formats.dense_rows == 4 and runner.formats.act_dtype == getattr(torch, kernel_act)
    table = runner.req_to_token_pool.table
    i64 = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    prompt, drafts = [5, 17, 33, 2, 90, 41], [7, 8, 9, 10, 11]

    def step(row, ids, cached, all_rows):
        pos = list(range(cached, cached + len(ids)))
        fb = ForwardBatch(input_ids=i64(ids), positions=i64(pos), out_cache_loc=i64([100 * row + p for p in pos]),
                          req_pool_indices=i64([row]), seq_lens=i64([cached + len(ids)]), extend_lens=i64([len(ids)]),
                          req_to_token=table, seq_lens_cpu=[cached + len(ids)], extend_lens_cpu=[len(ids)],
                          logits_indices=i64(list(range(len(ids)))) if all_rows else None, logits_all_rows=all_rows)
        return runner.forward(fb)

    for row in (1, 2):
        table[row, :64] = torch.arange(100 * row, 100 * row + 64)
        step(row, prompt, 0, False)
    decodes = torch.cat([step(1, [t], len(prompt) + k, True) for k, t in enumerate(drafts)])
    verify = step(2, drafts, len(prompt), True)
    assert torch.equal(verify, decodes)
