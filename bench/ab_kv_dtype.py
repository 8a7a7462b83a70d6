"""KV cache dtype A/B: decode steps on a float32 KV pool against a bfloat16 one (--kv-cache-dtype bf16).

Two model runners of the same weights in this process, one per pool dtype, step alternately
(the order flipped every round, so a busy machine slows both alike); per (batch, context
length) the median step of each and their ratio. The contexts are each request's own slots
(no shared prefix), so every step reads batch x context tokens of K and V per layer.

    python bench/ab_kv_dtype.py --batch-sizes 1 8 --contexts 140 512 2000 4000 --rounds 60
Writes bench/results/ab_kv_dtype.json and bench/results/ab_kv_dtype.png.
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
from tqdm import tqdm  # noqa: E402

from bench.one_batch import RESULTS, Batches, cpu_flags  # noqa: E402
from lmprog_runtime.model_executor.runner import ModelRunner  # noqa: E402

DTYPES = ("auto", "bf16")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", default="default")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--contexts", type=int, nargs="+", default=[140, 512, 2000, 4000])
    ap.add_argument("--rounds", type=int, default=60, help="steps of each dtype per point")
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--results-dir", default=RESULTS)
    args = ap.parse_args()
    max_bs, max_len = max(args.batch_sizes), max(args.contexts) + 2
    runners = {}
    for kv in DTYPES:
        runner = ModelRunner(ServerArgs(model_path=args.model_path, kv_cache_dtype=kv, num_threads=args.num_threads,
                                        max_total_tokens=max_bs * max_len + 16, max_running_requests=max_bs,
                                        context_length=max(max_len, 1024)))
        runners[kv] = (runner, Batches(runner, max_len))
    points = []
    bar = tqdm(total=len(args.batch_sizes) * len(args.contexts), desc="ab_kv_dtype")
    for bs in args.batch_sizes:
        for ctx in args.contexts:
            times = {kv: [] for kv in DTYPES}
            for kv, (runner, batches) in runners.items():
                batches.fill(bs, ctx)  # the contexts' K/V in memory, as prefills leave them
                for _ in range(3):
                    runner.forward(batches.make(bs, ctx, 1))
            for i in range(args.rounds):
                for kv in (DTYPES if i % 2 == 0 else DTYPES[::-1]):
                    runner, batches = runners[kv]
                    fb = batches.make(bs, ctx, 1)
                    t0 = time.perf_counter()
                    runner.forward(fb)
                    times[kv].append(time.perf_counter() - t0)
            f32, bf16 = (1e3 * statistics.median(times[kv]) for kv in DTYPES)
            points.append({"batch": bs, "context": ctx, "float32_ms": f32, "bfloat16_ms": bf16, "ratio": bf16 / f32})
            bar.update()
    bar.close()
    runner = runners["auto"][0]
    out = {"model": args.model_path, "formats": str(runner.formats), "cpu_flags": cpu_flags(),
           "threads": torch.get_num_threads(), "rounds": args.rounds, "points": points}
    os.makedirs(args.results_dir, exist_ok=True)
    path = os.path.join(args.results_dir, "ab_kv_dtype.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=2)
    plot(out, path.replace(".json", ".png"))
    print(f"{'batch':>5} {'context':>7} {'fp32 KV ms':>10} {'bf16 KV ms':>10} {'ratio':>6}")
    for p in points:
        print(f"{p['batch']:>5} {p['context']:>7} {p['float32_ms']:>10.2f} {p['bfloat16_ms']:>10.2f} {p['ratio']:>6.3f}")


def plot(out, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({p["batch"] for p in out["points"]})
    fig, axes = plt.subplots(1, len(batches), figsize=(4.5 * len(batches), 3.6), squeeze=False)
    for ax, bs in zip(axes[0], batches):
        pts = [p for p in out["points"] if p["batch"] == bs]
        ctx = [p["context"] for p in pts]
        ax.plot(ctx, [p["float32_ms"] for p in pts], "o-", label="float32 KV")
        ax.plot(ctx, [p["bfloat16_ms"] for p in pts], "s-", label="bfloat16 KV")
        ax.set_xlabel("context tokens per request")
        ax.set_ylabel("decode step (ms)")
        ax.set_title(f"batch {bs} ({out['cpu_flags']}, {out['threads']} threads)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
