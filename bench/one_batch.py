"""One-batch benchmark (after SGLang's bench_one_batch): the model runner alone, no scheduler.

Measures the machine first (matmul peak in fp32/bf16, memory-copy and read-only bandwidth), then
prefill tokens/s for one prompt and decode tokens/s at several batch sizes through
`ModelRunner.forward`, and relates them to the machine:
- prefill as % of matmul peak (FLOPs ~ 2 x params x tokens + attention),
- each decode step (the median of --steps steps, the ForwardBatch built outside the timing) vs
  its floor "bytes of weights the step reads / memory-copy bandwidth" (issue #19's definition;
  with `--quantization`, small batches read the packed weights, large ones the kept dense copy),
  and vs the floor that adds the K/V the step attends over (batch x cached tokens x layers x
  K and V rows),
- the batch-32 / batch-1 decode throughput ratio.

    python bench/one_batch.py --dtype float32 --batch-sizes 1 8 32 64 --input-len 512 --output-len 16
    python bench/one_batch.py --quantization auto --batch-sizes 1 8 32 --quick
    python bench/one_batch.py --quick --ab-fused-layer 1 4   # + fused vs layer-by-layer, interleaved
Writes bench/results/one_batch.json and bench/results/one_batch.png. `--no-fused-layer` runs
quantized decode steps layer by layer (model_executor/llama_layer.py off; LMPROG_NO_FUSED_LAYER=1
does the same for a server); `--ab-fused-layer B...` adds an interleaved A/B of the two paths in
this process (alternating steps, order flipped each round: ratios hold on a busy machine).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lmprog_runtime.config import ServerArgs  # noqa: E402  (before torch: sets OpenMP's wait policy)
import torch  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from lmprog_runtime.model_executor.forward_batch import ForwardBatch  # noqa: E402
from lmprog_runtime.model_executor.runner import ModelRunner  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


DEVICE = torch.device("cpu")  # set from the runner in main(); GPU work is timed after a synchronize


def best_time(fn, reps: int = 3) -> float:
    sync = torch.cuda.synchronize if DEVICE.type == "cuda" else (lambda: None)
    fn()  # warm-up
    sync()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def matmul_gflops(dtype: torch.dtype, n: int = 2048) -> float:
    if dtype == torch.bfloat16 and DEVICE.type == "cpu" and not {"avx512_bf16", "amx_bf16"} & set(cpu_flags().split()):
        n = 512  # no bfloat16 dot products: torch's fallback takes minutes at 2048
    a, b = torch.randn(n, n, dtype=dtype, device=DEVICE), torch.randn(n, n, dtype=dtype, device=DEVICE)
    return 2 * n ** 3 / best_time(lambda: a @ b) / 1e9


def copy_gbps(mbytes: int = 256) -> float:
    src = torch.empty(mbytes << 20, dtype=torch.uint8, device=DEVICE).random_()
    dst = torch.empty_like(src)
    return 2 * src.numel() / best_time(lambda: dst.copy_(src), reps=5) / 1e9  # read + write


def read_gbps(mbytes: int = 256) -> float:
    """Read-only bandwidth (what streaming weights through a decode step gets): a float32 sum."""
    src = torch.empty((mbytes << 20) // 4, dtype=torch.float32, device=DEVICE).uniform_()
    return 4 * src.numel() / best_time(lambda: src.sum()) / 1e9


def median_step(runner, batches, batch: int, cached: int, steps: int):
    """(median, best) seconds of `steps` decode steps of `batch` requests over `cached` tokens,
    after 3 warm-up steps; each step's ForwardBatch is built before its timer starts."""
    sync = torch.cuda.synchronize if DEVICE.type == "cuda" else (lambda: None)
    times = []
    for i in range(steps + 3):
        fb = batches.make(batch, cached, 1)
        sync()
        t0 = time.perf_counter()
        runner.forward(fb)
        sync()
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return statistics.median(times), min(times)


def step_kv_bytes(runner, batch: int, cached: int) -> int:
    """Bytes of K and V a decode step of `batch` requests over `cached` tokens each reads."""
    pool, c = runner.token_to_kv_pool, runner.model_config
    return batch * cached * c.num_layers * 2 * c.num_kv_heads * c.head_dim * pool.k.element_size()


def step_weight_bytes(model: torch.nn.Module, batch: int) -> int:
    """Bytes of weights one forward over `batch` rows reads: a QuantLinear's packed buffers below
    its `dense_rows`, else its dense copy; every other parameter once, except the embedding
    table (only `batch` rows are gathered) unless it is also the logits head."""
    from lmprog_runtime.model_executor.quant import QuantLinear

    total, seen = 0, set()
    for mod in model.modules():
        if isinstance(mod, QuantLinear):
            use_dense = mod.dense is not None and batch >= mod.dense_rows
            names = ["dense"] if use_dense else [n for n in ("qweight", "scales", "scale_zeros", "scale_mins") if hasattr(mod, n)]
            bufs = [getattr(mod, n) for n in names] + ([mod.bias] if mod.bias is not None else [])
            total += sum(b.numel() * b.element_size() for b in bufs)
            seen.update(id(b) for b in mod.buffers())
    head_is_embedding = getattr(model, "lm_head", None) is None and getattr(model, "quant_head", None) is None
    for name, p in model.named_parameters():
        if id(p) in seen or (name == "embed_tokens.weight" and not head_is_embedding):
            continue
        total += p.numel() * p.element_size()
    return total


class Batches:
    """Hand-built ForwardBatches: request i owns table row i+1 and a contiguous run of slots."""

    def __init__(self, runner: ModelRunner, max_len: int):
        self.runner, self.max_len = runner, max_len

    def fill(self, batch: int, cached: int) -> None:
        """Write K/V (random values) into the first `cached` slots of requests 0..batch-1, as
        their prefills would: a large pool is allocated lazily (kv_pool.py), and slots never
        written read the kernel's shared zero page, which the cache holds, not memory."""
        pool = self.runner.token_to_kv_pool
        slots = self._layout(batch)[:, :cached].reshape(-1)
        for cache in (pool.k, pool.v):
            cache[:, slots] = torch.randn((cache.shape[0], slots.numel()) + tuple(cache.shape[2:])).to(cache.dtype)

    def _layout(self, batch: int) -> torch.Tensor:
        """Table rows 1..batch: request i's slots, a contiguous run from 1 + i * max_len ([B, max_len])."""
        table = self.runner.req_to_token_pool.table
        i64 = dict(dtype=torch.int64, device=self.runner.device)
        base = 1 + torch.arange(batch, **i64) * self.max_len  # [B] first slot of each request
        table[1:batch + 1, :self.max_len] = base[:, None] + torch.arange(self.max_len, **i64)[None, :]
        return table[1:batch + 1, :self.max_len]

    def make(self, batch: int, cached: int, new: int) -> ForwardBatch:
        table = self.runner.req_to_token_pool.table
        i64 = dict(dtype=torch.int64, device=self.runner.device)
        rows = torch.arange(1, batch + 1, **i64)
        base = self._layout(batch)[:, 0]  # [B] first slot of each request
        pos = torch.arange(cached, cached + new, **i64)
        return ForwardBatch(
            input_ids=torch.randint(100, 40000, (batch * new,), **i64),
            positions=pos.repeat(batch), out_cache_loc=(base[:, None] + pos[None, :]).reshape(-1),
            req_pool_indices=rows, seq_lens=torch.full((batch,), cached + new, **i64),
            extend_lens=torch.full((batch,), new, **i64), req_to_token=table,
            seq_lens_cpu=[cached + new] * batch, extend_lens_cpu=[new] * batch,
        )


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", default="default")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--steps", type=int, default=None, help="decode steps timed per batch size (median; default 40, --quick 15)")
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--quantization", default="auto", choices=["auto", "none", "int8", "int4"])
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bf16", "bfloat16"])
    ap.add_argument("--quick", action="store_true", help="batch sizes 1 8 32, a 128-token prompt, fewer repetitions")
    ap.add_argument("--profile", action="store_true", help="print torch.profiler's top ops of one decode step")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--attention-backend", default=None, choices=["torch_native", "triton", "flashinfer"],
                    help="default: the runner's per-device default")
    ap.add_argument("--results-dir", default=RESULTS)
    ap.add_argument("--no-fused-layer", action="store_true", help="quantized decode steps layer by layer")
    ap.add_argument("--ab-fused-layer", type=int, nargs="*", default=None, metavar="B",
                    help="interleaved A/B of fused vs layer-by-layer decode steps at these batch sizes")
    ap.add_argument("--ab-rounds", type=int, default=60)
    args = ap.parse_args()
    from lmprog_runtime.model_executor import llama_layer

    llama_layer.enabled = not args.no_fused_layer
    if args.quick:
        args.batch_sizes, args.input_len, args.output_len = [1, 8, 32], 128, 8

    max_bs, max_len = max(args.batch_sizes + (args.ab_fused_layer or [])), args.input_len + args.output_len + 1
    global DEVICE
    runner = ModelRunner(ServerArgs(model_path=args.model_path, dtype=args.dtype, num_threads=args.num_threads,
                                    quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
                                    device=args.device, attention_backend=args.attention_backend,
                                    max_total_tokens=max_bs * max_len + 16, max_running_requests=max_bs,
                                    context_length=max(max_len, 1024)))
    DEVICE = runner.device
    c = runner.model_config
    params = sum(p.numel() for p in runner.model.parameters()) + sum(
        m.out_features * m.in_features for m in runner.model.modules() if hasattr(m, "qweight"))
    steps = len(args.batch_sizes) + 3
    bar = tqdm(total=steps, desc="bench")

    peak = {"float32": matmul_gflops(torch.float32)}
    bar.update()
    peak["bfloat16"] = matmul_gflops(torch.bfloat16)
    bar.update()
    bandwidth, read_bandwidth = copy_gbps(), read_gbps()
    bar.update()

    batches = Batches(runner, max_len)
    n = args.input_len
    t_prefill = best_time(lambda: runner.forward(batches.make(1, 0, n)), reps=2)
    attn_flops = 4 * c.num_layers * c.num_heads * c.head_dim * n * n / 2  # causal QK^T + PV
    prefill_flops = 2 * params * n + attn_flops
    dtype_name = str(runner.dtype).replace("torch.", "")
    # a prefill's GEMMs run in the kept dense copies' dtype where it differs from the activations'
    gemm_name = str(runner.formats.dense_weight_dtype or runner.dtype).replace("torch.", "")
    result = {
        "model": args.model_path, "dtype": dtype_name, "quantization": runner.quantization,
        "kv_cache_dtype": str(runner.kv_dtype).removeprefix("torch."),
        "formats": str(runner.formats), "cpu_flags": cpu_flags(), "threads": torch.get_num_threads(), "params": params,
        "device": str(runner.device), "attention_backend": runner.attention_backend_name,
        "matmul_peak_gflops": peak, "copy_bandwidth_gbps": bandwidth, "read_bandwidth_gbps": read_bandwidth,
        "prefill": {"input_len": n, "seconds": t_prefill, "tokens_per_s": n / t_prefill,
                    "pct_of_matmul_peak": 100 * prefill_flops / t_prefill / 1e9 / peak.get(gemm_name, peak["float32"])},
        "decode": {},
    }
    steps = args.steps or (15 if args.quick else 40)
    for bs in args.batch_sizes:
        # each step attends over n cached tokens, written first (their values do not change the timing)
        batches.fill(bs, n)
        t, best = median_step(runner, batches, bs, n, steps)
        weights, kv = step_weight_bytes(runner.model, bs), step_kv_bytes(runner, bs, n)
        floor_ms = 1e3 * weights / (bandwidth * 1e9)  # weights read once, at the copy bandwidth
        floor_kv_ms = 1e3 * (weights + kv) / (bandwidth * 1e9)
        result["decode"][str(bs)] = {"step_ms": 1e3 * t, "step_ms_best": 1e3 * best, "steps": steps,
                                     "tokens_per_s": bs / t, "weight_bytes": weights, "kv_bytes": kv,
                                     "floor_ms": floor_ms, "over_floor": 1e3 * t / floor_ms,
                                     "floor_kv_ms": floor_kv_ms, "over_floor_kv": 1e3 * t / floor_kv_ms}
        bar.update()
    bar.close()

    d1 = result["decode"].get("1")
    if d1:
        result["decode_b1_vs_bandwidth_floor"] = {"floor_ms": d1["floor_ms"], "ratio": d1["over_floor"],
                                                  "floor_kv_ms": d1["floor_kv_ms"], "ratio_kv": d1["over_floor_kv"],
                                                  "definition": "bytes / memory-copy bandwidth (read + write)"}
    if d1 and "32" in result["decode"]:
        result["decode_b32_over_b1_throughput"] = result["decode"]["32"]["tokens_per_s"] / d1["tokens_per_s"]
    if args.ab_fused_layer:
        result["fused_layer_ab"] = ab_fused_layer(runner, batches, args.ab_fused_layer, n, args.ab_rounds)
    report(result)
    save(result, args.results_dir)
    if args.profile:
        from torch.profiler import profile

        fb = batches.make(args.batch_sizes[0], n, 1)
        with profile() as prof:
            runner.forward(fb)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


def ab_fused_layer(runner, batches, sizes, cached: int, rounds: int) -> dict:
    """Fused (llama_layer.c) vs layer-by-layer decode steps, one of each per round in this process,
    order flipped every round: per batch size each side's median step and the median of the
    per-round ratios fused / layer-by-layer (< 1: the fused step is faster)."""
    import statistics

    from lmprog_runtime.model_executor import llama_layer

    out = {}
    for bs in sizes:
        times = {True: [], False: []}
        for fused in (True, False, True, False):  # warm-up: buffers, binding, caches
            llama_layer.enabled = fused
            runner.forward(batches.make(bs, cached, 1))
        llama_layer.enabled = True
        fused_runs = llama_layer.plan(runner.model, bs) is not None
        for r in range(rounds):
            for fused in ((True, False) if r % 2 == 0 else (False, True)):
                llama_layer.enabled = fused
                fb = batches.make(bs, cached, 1)
                t0 = time.perf_counter()
                runner.forward(fb)
                times[fused].append(time.perf_counter() - t0)
        llama_layer.enabled = True
        ratios = [a / b for a, b in zip(times[True], times[False])]
        out[str(bs)] = {"rounds": rounds, "fused_path_taken": fused_runs,
                        "median_ms_fused": 1e3 * statistics.median(times[True]),
                        "median_ms_layer_by_layer": 1e3 * statistics.median(times[False]),
                        "median_ratio_fused_over_layer_by_layer": statistics.median(ratios)}
    return out


def cpu_flags() -> str:
    """The vector extensions that decide which CPU kernels win (AVX2 / AVX-512 / AMX)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return "unknown"
    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")
    return " ".join(w for w in wanted if w in flags) or "none of avx2/avx512/amx"


def report(r: dict) -> None:
    print(f"\nmodel {r['model']} ({r['params'] / 1e6:.0f}M params), {r['dtype']}, "
          f"weights {r['quantization']}, {r['threads']} threads; CPU {r['cpu_flags']}")
    print(f"matmul peak: fp32 {r['matmul_peak_gflops']['float32']:.0f} GFLOP/s, "
          f"bf16 {r['matmul_peak_gflops']['bfloat16']:.0f} GFLOP/s; copy bandwidth {r['copy_bandwidth_gbps']:.1f} GB/s, read {r['read_bandwidth_gbps']:.1f} GB/s")
    p = r["prefill"]
    print(f"prefill {p['input_len']} tokens: {p['tokens_per_s']:.0f} tok/s ({p['pct_of_matmul_peak']:.0f}% of peak)")
    print(f"{'batch':>6} {'step ms':>9} {'best ms':>9} {'tok/s':>9} {'floor ms':>9} {'x floor':>8} {'+kv ms':>8} {'x +kv':>6}")
    for bs, d in r["decode"].items():
        print(f"{bs:>6} {d['step_ms']:>9.2f} {d['step_ms_best']:>9.2f} {d['tokens_per_s']:>9.1f} {d['floor_ms']:>9.2f} "
              f"{d['over_floor']:>8.2f} {d['floor_kv_ms']:>8.2f} {d['over_floor_kv']:>6.2f}")
    if "decode_b1_vs_bandwidth_floor" in r:
        f = r["decode_b1_vs_bandwidth_floor"]
        print(f"batch-1 step (median) vs its floor, weight bytes / copy bandwidth {f['floor_ms']:.2f} ms: "
              f"{f['ratio']:.2f}x; with the K/V it reads {f['floor_kv_ms']:.2f} ms: {f['ratio_kv']:.2f}x")
    if "decode_b32_over_b1_throughput" in r:
        print(f"decode throughput batch 32 / batch 1: {r['decode_b32_over_b1_throughput']:.1f}x")
    for bs, a in r.get("fused_layer_ab", {}).items():
        print(f"fused layer vs layer by layer, batch {bs} ({a['rounds']} interleaved rounds, fused path "
              f"{'taken' if a['fused_path_taken'] else 'NOT taken'}): median {a['median_ms_fused']:.2f} ms vs "
              f"{a['median_ms_layer_by_layer']:.2f} ms, median ratio {a['median_ratio_fused_over_layer_by_layer']:.3f}")


def save(r: dict, results_dir: str = RESULTS) -> None:
    os.makedirs(results_dir, exist_ok=True)
    with open(os.path.join(results_dir, "one_batch.json"), "w") as f:
        json.dump(r, f, indent=2)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [int(b) for b in r["decode"]]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(sizes, [r["decode"][str(b)]["tokens_per_s"] for b in sizes], marker="o")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("decode batch size")
    ax.set_ylabel("tokens / s")
    ax.set_title(f"{r['model']} {r['dtype']}: decode throughput "
                 f"(prefill {r['prefill']['tokens_per_s']:.0f} tok/s)")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(results_dir, "one_batch.png"), dpi=100)


if __name__ == "__main__":
    main()
