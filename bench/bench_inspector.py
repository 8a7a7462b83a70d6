"""What the Inspector costs the scheduler (docs/inspector.md).

    python bench/bench_inspector.py [--quick]

1. The tree walk of one `/inspect/state` answer (cache/tree_view.py), on synthetic radix
   trees of 1,000 to 50,000 nodes, bounded to 2,000 nodes (the page's default) and to all
   of them (at most 20,000): median wall seconds of a few runs, and the JSON size. This is
   the part that grows with the tree; the rest of a snapshot is O(requests).
2. The per-step price on the hot path: one `StepRing.record` call, in microseconds.

Writes bench/results/inspector.json and bench/results/inspector.png. Timings are only
worth keeping from a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

from inspect_helpers import decode, tree_of_at_least  # noqa: E402

from lmprog_runtime.cache.tree_view import tree_view  # noqa: E402
from lmprog_runtime.messages import INSPECT_MAX_NODES_CAP, INSPECT_MAX_NODES_DEFAULT  # noqa: E402
from lmprog_runtime.scheduler.inspect import StepRing  # noqa: E402

RESULTS = os.path.join(HERE, "results")


def time_view(tree, max_nodes: int, repeats: int) -> dict:
    runs, size = [], 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        view = tree_view(tree, decode, max_nodes)
        runs.append(time.perf_counter() - t0)
        size = len(json.dumps(view))
    return {"max_nodes": max_nodes, "shown": view["shown"], "seconds": statistics.median(runs),
            "json_bytes": size}


def ring_cost(calls: int = 200_000) -> float:
    """Microseconds per StepRing.record."""
    ring = StepRing()
    t0 = time.perf_counter()
    for i in range(calls):
        ring.record(0.01, 0.008, 0.0, 0.001 * i, 8, 8)
    return (time.perf_counter() - t0) / calls * 1e6


def plot(rows: list, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for key, label in (("bounded", f"max_nodes={INSPECT_MAX_NODES_DEFAULT}"), ("full", "all nodes (<= 20,000)")):
        ax.plot([r["nodes"] for r in rows], [r[key]["seconds"] * 1000 for r in rows], "o-", label=label)
    ax.set_xlabel("radix tree nodes")
    ax.set_ylabel("tree walk of one snapshot (ms)")
    ax.set_title("Inspector: scheduler time per /inspect/state")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="trees of 1,000 and 5,000 nodes, one run each")
    ap.add_argument("--output", default=os.path.join(RESULTS, "inspector.json"))
    args = ap.parse_args()
    sizes = [1000, 5000] if args.quick else [1000, 5000, 10_000, 20_000, 50_000]
    repeats = 1 if args.quick else 3
    rows = []
    for n in sizes:
        _, tree, _ = tree_of_at_least(n)
        nodes = sum(1 for _ in tree.nodes())
        row = {"nodes": nodes, "bounded": time_view(tree, INSPECT_MAX_NODES_DEFAULT, repeats),
               "full": time_view(tree, min(nodes, INSPECT_MAX_NODES_CAP), repeats)}
        rows.append(row)
        print(f"{nodes:>6} nodes: {row['bounded']['seconds'] * 1000:7.1f} ms bounded, "
              f"{row['full']['seconds'] * 1000:7.1f} ms full ({row['full']['json_bytes'] / 1e6:.1f} MB JSON)")
    record_us = ring_cost(20_000 if args.quick else 200_000)
    print(f"StepRing.record: {record_us:.2f} us per step")
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump({"quick": args.quick, "trees": rows, "step_ring_record_us": record_us}, f, indent=1)
    plot(rows, os.path.splitext(args.output)[0] + ".png")


if __name__ == "__main__":
    main()
