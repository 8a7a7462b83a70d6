"""A/B of the batch-1 decode step: this tree against a git revision (`--ref`), in alternating
subprocesses so both see the same machine load; reports each side's median step and the median
of the per-round ratios (new / old). Meant for busy machines, where absolute times mean little
but interleaved ratios still do.

    python bench/ab_decode_step.py --ref 3f45bf5 --dtype float32 --rounds 6
    python bench/ab_decode_step.py --ref 3f45bf5 --dtype auto --quick
Writes bench/results/ab_decode_step_<dtype>.json and a PNG of the per-round step times.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")

# run inside one tree (its root first on sys.path): median batch-1 decode step in ms, as JSON
WORKER = r"""
import json, os, statistics, sys, time
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, sys.argv[1])
from lmprog_runtime.config import ServerArgs
import torch
from bench.one_batch import Batches
from lmprog_runtime.model_executor.runner import ModelRunner
dtype, quant, cached, steps, threads, batch = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), \
    int(sys.argv[6]) or None, int(sys.argv[7])
r = ModelRunner(ServerArgs(model_path="default", dtype=dtype, quantization=quant, num_threads=threads,
                           max_total_tokens=(batch + 1) * (cached + 8) + 16, max_running_requests=batch + 1,
                           context_length=max(cached + 8, 1024)))
b = Batches(r, cached + 8)
for _ in range(3):
    r.forward(b.make(batch, cached, 1))
times = []
for _ in range(steps):
    fb = b.make(batch, cached, 1)
    t0 = time.perf_counter()
    r.forward(fb)
    times.append(time.perf_counter() - t0)
print("RESULT " + json.dumps({"step_ms": 1e3 * statistics.median(times), "formats": str(r.formats)}))
"""


def run_side(tree: str, args) -> dict:
    cmd = [sys.executable, "-c", WORKER, tree, args.dtype, args.quantization, str(args.cached), str(args.steps),
           str(args.num_threads or 0), str(args.batch)]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=tree, timeout=900)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"worker in {tree} failed: {out.stderr[-2000:]}")
    return json.loads(line[len("RESULT "):])


def export_ref(ref: str, dest: str) -> None:
    """The tree at `ref` (committed files only) into `dest`."""
    archive = subprocess.run(["git", "-C", ROOT, "archive", ref], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", dest], input=archive, check=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ref", required=True, help="the old revision (e.g. the merge base)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--cached", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--quick", action="store_true", help="3 rounds of 15 steps")
    ap.add_argument("--results-dir", default=RESULTS)
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.steps = 3, 15
    rounds = []
    with tempfile.TemporaryDirectory() as old_tree:
        export_ref(args.ref, old_tree)
        for i in range(args.rounds):
            order = [("old", old_tree), ("new", ROOT)] if i % 2 == 0 else [("new", ROOT), ("old", old_tree)]
            got = {name: run_side(tree, args) for name, tree in order}
            rounds.append(got)
            print(f"round {i}: old {got['old']['step_ms']:.2f} ms, new {got['new']['step_ms']:.2f} ms, "
                  f"ratio {got['new']['step_ms'] / got['old']['step_ms']:.3f}", flush=True)
    ratios = [r["new"]["step_ms"] / r["old"]["step_ms"] for r in rounds]
    formats = {r[s]["formats"] for r in rounds for s in ("old", "new")}
    result = {"ref": args.ref, "dtype": args.dtype, "quantization": args.quantization, "batch": args.batch,
              "cached": args.cached, "rounds": rounds, "median_ratio_new_over_old": statistics.median(ratios),
              "old_median_ms": statistics.median(r["old"]["step_ms"] for r in rounds),
              "new_median_ms": statistics.median(r["new"]["step_ms"] for r in rounds),
              "formats": sorted(formats), "same_formats": len(formats) == 1}
    print(f"median ratio new/old {result['median_ratio_new_over_old']:.3f} "
          f"({'same' if result['same_formats'] else 'DIFFERENT'} formats: {sorted(formats)})")
    os.makedirs(args.results_dir, exist_ok=True)
    stem = os.path.join(args.results_dir, f"ab_decode_step_{args.dtype}_b{args.batch}")
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=2)
    plot(rounds, stem + ".png", f"batch-{args.batch} decode step, --dtype {args.dtype}")


def plot(rounds, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for side in ("old", "new"):
        ax.plot([r[side]["step_ms"] for r in rounds], marker="o", label=side)
    ax.set_xlabel("round (alternating order)")
    ax.set_ylabel("median step (ms)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    main()
