"""A/B of the batch-1 decode step: this tree against a git revision (`--ref`), one worker process
per tree (model loaded once), stepping alternately, one step each, so both see the same machine
load; reports each side's median step and the median of the per-pair ratios (new / old). Meant
for busy machines, where absolute times mean little but interleaved ratios still do.

    python bench/ab_decode_step.py --ref 3f45bf5 --dtype float32 --quantization none
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

# run inside one tree (its root first on sys.path): loads the model once, then times one
# batch-B decode step per line read from stdin, answering each with its milliseconds
WORKER = r"""
import json, os, sys, time
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, sys.argv[1])
from lmprog_runtime.config import ServerArgs
import torch
from bench.one_batch import Batches
from lmprog_runtime.model_executor.runner import ModelRunner
dtype, quant, cached, threads, batch = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]) or None, \
    int(sys.argv[6])
r = ModelRunner(ServerArgs(model_path="default", dtype=dtype, quantization=quant, num_threads=threads,
                           max_total_tokens=(batch + 1) * (cached + 8) + 16, max_running_requests=batch + 1,
                           context_length=max(cached + 8, 1024)))
b = Batches(r, cached + 8)
if hasattr(b, "fill"):  # contexts written (a large pool is allocated lazily: unwritten slots read a zero page)
    b.fill(batch, cached)
for _ in range(3):
    r.forward(b.make(batch, cached, 1))
print("READY " + json.dumps({"formats": str(r.formats)}), flush=True)
for line in sys.stdin:
    fb = b.make(batch, cached, 1)
    t0 = time.perf_counter()
    r.forward(fb)
    print(f"{1e3 * (time.perf_counter() - t0):.4f}", flush=True)
"""


class Side:
    """One worker process on one tree."""

    def __init__(self, tree: str, args):
        cmd = [sys.executable, "-c", WORKER, tree, args.dtype, args.quantization, str(args.cached),
               str(args.num_threads or 0), str(args.batch)]
        self.proc = subprocess.Popen(cmd, cwd=tree, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True)
        line = self.proc.stdout.readline()
        if not line.startswith("READY "):
            self.close()
            raise RuntimeError(f"worker in {tree} failed to start")
        self.formats = json.loads(line[len("READY "):])["formats"]

    def step_ms(self) -> float:
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline())

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


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
    ap.add_argument("--pairs", type=int, default=300, help="old/new step pairs")
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--quick", action="store_true", help="60 pairs")
    ap.add_argument("--results-dir", default=RESULTS)
    args = ap.parse_args()
    if args.quick:
        args.pairs = 60
    with tempfile.TemporaryDirectory() as old_tree:
        export_ref(args.ref, old_tree)
        sides = {"old": Side(old_tree, args), "new": Side(ROOT, args)}
        try:
            pairs = []  # (old ms, new ms), the two steps back to back, order alternating
            for i in range(args.pairs):
                order = ("old", "new") if i % 2 == 0 else ("new", "old")
                got = {name: sides[name].step_ms() for name in order}
                pairs.append((got["old"], got["new"]))
        finally:
            for side in sides.values():
                side.close()
    ratios = [n / o for o, n in pairs]
    result = {"ref": args.ref, "dtype": args.dtype, "quantization": args.quantization, "batch": args.batch,
              "cached": args.cached, "pairs": pairs, "median_ratio_new_over_old": statistics.median(ratios),
              "old_median_ms": statistics.median(o for o, _ in pairs),
              "new_median_ms": statistics.median(n for _, n in pairs),
              "formats": {name: side.formats for name, side in sides.items()},
              "same_formats": sides["old"].formats == sides["new"].formats}
    print(f"{len(pairs)} step pairs: old median {result['old_median_ms']:.2f} ms, "
          f"new {result['new_median_ms']:.2f} ms; "
          f"median ratio new/old {result['median_ratio_new_over_old']:.3f} "
          f"({'same' if result['same_formats'] else 'DIFFERENT'} formats: {result['formats']['new']})")
    os.makedirs(args.results_dir, exist_ok=True)
    stem = os.path.join(args.results_dir, f"ab_decode_step_{args.dtype}_b{args.batch}"
                        + (f"_ctx{args.cached}" if args.cached != 128 else ""))
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=2)
    plot(pairs, stem + ".png", f"batch-{args.batch} decode step, --dtype {args.dtype}")


def plot(pairs, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for i, side in enumerate(("old", "new")):
        ax.plot([p[i] for p in pairs], marker=".", linestyle="none", label=side)
    ax.set_yscale("log")
    ax.set_xlabel("step pair (old and new back to back, order alternating)")
    ax.set_ylabel("step (ms)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    main()
