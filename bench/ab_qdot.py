"""A/B of the int8-activation kernels (qdot.c) against the float32-activation ones (qgemm.c) in
one process, calls alternating (order flipping each pair), so both see the same machine load:
the median of the per-pair time ratios (new / old) means something even on a busy machine.

- kernels: SmolLM2-135M's projections (qkv 960x576, o 576x576, gate_up 3072x576, down
  576x1536 in int4; the 49152x576 head in int8; k/v alone, 192x576, for reference) at T = 1, 4, 16;
- step: a whole batch-1 decode step of the embedded GGUF, one runner per kernel (int4 layers,
  int8 head, float32 dense), formats forced instead of probed.

    python bench/ab_qdot.py [--quick] [--num-threads 1]
Writes bench/results/ab_qdot_t<threads>.json and .png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from lmprog_runtime.config import ServerArgs  # noqa: E402  (before torch: sets OpenMP's wait policy)
import torch  # noqa: E402

from lmprog_runtime.model_executor import probe, qgemm  # noqa: E402
from lmprog_runtime.model_executor.quant import quantize_int4, quantize_int8  # noqa: E402

RESULTS = os.path.join(ROOT, "bench", "results")
SHAPES = [("qkv", "int4", 960, 576), ("k/v", "int4", 192, 576), ("o", "int4", 576, 576),
          ("gate_up", "int4", 3072, 576), ("down", "int4", 576, 1536), ("lm_head", "int8", 49152, 576)]


def interleaved(old, new, pairs: int):
    """(old s, new s) per pair, back to back, order alternating; after one warm-up call each."""
    old(), new()
    out = []
    for i in range(pairs):
        fns = (old, new) if i % 2 == 0 else (new, old)
        times = []
        for fn in fns:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        out.append(tuple(times) if i % 2 == 0 else (times[1], times[0]))
    return out


def summary(pairs):
    return {"median_ratio_new_over_old": statistics.median(n / o for o, n in pairs),
            "old_median_us": 1e6 * statistics.median(o for o, _ in pairs),
            "new_median_us": 1e6 * statistics.median(n for _, n in pairs)}


def kernel_ab(pairs: int):
    rows = []
    for name, fmt, n, k in SHAPES:
        w = torch.randn(n, k) * 0.05
        if fmt == "int8":
            old_bufs = new_bufs = quantize_int8(w)
        else:  # the same nibbles; the float kernel reads float32 scale pairs, qdot.c float16 ones
            blocks = quantize_int4(w)
            old_bufs, new_bufs = qgemm.pack_q4(*blocks), qgemm.pack_q4_f16(*blocks)
        old_fn = qgemm.q8_matmul if fmt == "int8" else qgemm.q4_matmul
        for T in (1, 4, 16):
            x = torch.randn(T, k)
            got = summary(interleaved(lambda: old_fn(x, *old_bufs), lambda: qgemm.dot_matmul(fmt, x, *new_bufs),
                                      pairs))
            rows.append({"name": name, "fmt": fmt, "N": n, "K": k, "T": T, **got})
            print(f"{name:>8} {fmt} {n}x{k} T={T:<3} new/old {got['median_ratio_new_over_old']:.3f}")
    return rows


def runner_with(act: str, threads=None):
    """A runner on the embedded GGUF, int4 layers, its probe replaced by 'act is fastest'."""
    from lmprog_runtime.model_executor.runner import ModelRunner

    real = probe.measure_cached
    probe.measure_cached = lambda config, formats: {
        f: {b: (0.5 if f[1] == act else 1.0) * b for b in probe.PROBE_BATCHES} for f in formats}
    try:
        return ModelRunner(ServerArgs(model_path="default", dtype="float32", quantization="int4", num_threads=threads,
                                      max_total_tokens=2 * 200, max_running_requests=2, context_length=1024))
    finally:
        probe.measure_cached = real


def step_ab(pairs: int, threads=None):
    from bench.one_batch import Batches

    runners = {act: runner_with(act, threads) for act in ("float32", "int8")}
    batches = {act: Batches(r, 200) for act, r in runners.items()}
    assert runners["int8"].formats.act_dtype == torch.int8 and runners["float32"].formats.act_dtype == torch.float32
    fb = {act: batches[act].make(1, 128, 1) for act in runners}
    got = summary(interleaved(lambda: runners["float32"].forward(fb["float32"]),
                              lambda: runners["int8"].forward(fb["int8"]), pairs))
    print(f"batch-1 decode step (128 cached) new/old {got['median_ratio_new_over_old']:.3f}")
    return got


def plot(rows, step, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.8))
    labels = [f"{r['name']}\nT={r['T']}" for r in rows] + ["step\nT=1"]
    ratios = [r["median_ratio_new_over_old"] for r in rows] + [step["median_ratio_new_over_old"]]
    ax.bar(range(len(ratios)), ratios, color=["tab:blue"] * len(rows) + ["tab:green"])
    ax.axhline(1.0, color="k", linewidth=0.8)
    ax.set_xticks(range(len(ratios)), labels, fontsize=6)
    ax.set_ylabel("time new / old (median of pairs)")
    ax.set_title("int8-activation kernels (qdot.c) vs float32-activation (qgemm.c)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=200)
    ap.add_argument("--quick", action="store_true", help="40 pairs")
    ap.add_argument("--num-threads", type=int, default=None, help="default: the runtime's (--num-threads)")
    ap.add_argument("--results-dir", default=RESULTS)
    args = ap.parse_args()
    if args.quick:
        args.pairs = 40
    if not qgemm.dot_available():
        sys.exit("qdot.c is not built here (no C compiler?)")
    step = step_ab(args.pairs, args.num_threads)  # its runner sets torch's threads for the kernels too
    rows = kernel_ab(args.pairs)
    result = {"isa": qgemm.dot_isa(), "threads": torch.get_num_threads(), "pairs": args.pairs,
              "kernels": rows, "step_b1": step}
    os.makedirs(args.results_dir, exist_ok=True)
    stem = os.path.join(args.results_dir, f"ab_qdot_t{torch.get_num_threads()}")
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=2)
    plot(rows, step, stem + ".png")


if __name__ == "__main__":
    main()
