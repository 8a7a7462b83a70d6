"""Overlap scheduling on vs off: the scheduler's share of step time and throughput.

    python bench/bench_overlap.py [--num-requests 64]

Runs the no-sharing workload of `bench_prefix_cache.py` (distinct ~200-token prompts,
32 output tokens, all at once) through the Engine with the overlap scheduler on and off.
"Scheduler share" = 1 - forward time / step time, from the scheduler's own counters
(with overlap on, the CPU work done during the forward is hidden and not counted).
Overlap is forced on for the "on" run: by default it is used only on GPUs, because on
this CPU it measured slower (see docs/benchmarks.md).
Writes bench/results/overlap.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from bench.bench_prefix_cache import measure  # noqa: E402
from bench.workloads import random_prompts  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default="default")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "overlap.json"))
    args = ap.parse_args()
    prompts = random_prompts(args.num_requests, 200, random.Random(0))
    results = {"config": vars(args)}
    for overlap in (True, False):
        opts = argparse.Namespace(dtype=args.dtype, policy="fcfs", max_total_tokens=None,
                                  disable_overlap=not overlap, force_overlap=overlap, output_len=args.output_len)
        results["on" if overlap else "off"] = measure(args.model_path, True, prompts, opts)
        print(("overlap on" if overlap else "overlap off"), json.dumps(results["on" if overlap else "off"]), flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    on, off = results["on"], results["off"]
    print(f"scheduler share: {on['scheduler_share']:.1%} (overlap on) vs {off['scheduler_share']:.1%} (off); "
          f"throughput {on['request_throughput'] / off['request_throughput']:.2f}x")


if __name__ == "__main__":
    main()
