"""Per-call timing of one decode step, fused layer (model_executor/llama_layer.c) vs layer by layer:
perf_counter timers around every QuantLinear call (by shape), the attention backend's forward,
the RMSNorm modules, rope + KV write, silu * up, and the fused path's two C calls per layer;
"rest" is the step minus the timed calls (module calls, Python, small torch ops). The timers
add ~0.3 us a call, so absolute figures are upper bounds; on a busy machine compare the
columns, not the milliseconds.

    python bench/decode_step_calls.py --cached 140 --steps 30
    python bench/decode_step_calls.py --quick
Writes bench/results/decode_step_calls.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lmprog_runtime.config import ServerArgs  # noqa: E402  (before torch: sets OpenMP's wait policy)

from bench.one_batch import RESULTS, Batches  # noqa: E402
from lmprog_runtime.model_executor import decode_ops, fused_ops, llama_layer  # noqa: E402
from lmprog_runtime.model_executor.quant import QuantLinear  # noqa: E402
from lmprog_runtime.model_executor.runner import ModelRunner  # noqa: E402
from lmprog_runtime.models import llama  # noqa: E402

TOTALS = defaultdict(float)  # call name -> seconds over the timed steps
COUNTS = defaultdict(int)


def timed(fn, name_of):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            name = name_of(*args)
            TOTALS[name] += time.perf_counter() - t0
            COUNTS[name] += 1
    return wrapper


def instrument(runner) -> None:
    """Timers around the calls a decode step makes (class-level patches, so both paths see them)."""
    QuantLinear.forward = timed(QuantLinear.forward, lambda m, x: f"QuantLinear {m.out_features}x{m.in_features}")
    backend = type(runner.attn_backend)
    backend.forward = timed(backend.forward, lambda *a: "attention backend forward")
    llama.RMSNorm.forward = timed(llama.RMSNorm.forward, lambda *a: "RMSNorm")
    decode_ops.rope_kv = timed(decode_ops.rope_kv, lambda *a: "rope + KV write")
    fused_ops.silu_mul = timed(fused_ops.silu_mul, lambda *a: "silu * up")
    run = llama_layer.FusedLayers.run

    def fused_run(self, *args):
        if not getattr(self, "_timed", False):
            self.head = timed(self.head, lambda *a: "lm_layer_head (norm, qkv, rope + KV)")
            self.tail = timed(self.tail, lambda *a: "lm_layer_tail (o .. down [+ next head])")
            self._timed = True
        return run(self, *args)

    llama_layer.FusedLayers.run = fused_run


def measure(runner, batches, batch: int, cached: int, steps: int, fused: bool) -> dict:
    llama_layer.enabled = fused
    batches.fill(batch, cached)  # the context's K/V in memory (Batches.fill)
    for _ in range(3):
        runner.forward(batches.make(batch, cached, 1))
    TOTALS.clear()
    COUNTS.clear()
    wall = 0.0
    for _ in range(steps):
        fb = batches.make(batch, cached, 1)
        t0 = time.perf_counter()
        runner.forward(fb)
        wall += time.perf_counter() - t0
    calls = {k: {"calls_per_step": COUNTS[k] / steps, "us_per_call": 1e6 * TOTALS[k] / COUNTS[k],
                 "ms_per_step": 1e3 * TOTALS[k] / steps} for k in sorted(TOTALS)}
    # the attention backend runs inside no other timed call; the QuantLinear calls of the
    # layer-by-layer path neither; the head is a QuantLinear on both paths
    timed_ms = sum(c["ms_per_step"] for c in calls.values())
    return {"fused": fused, "step_ms": 1e3 * wall / steps, "calls": calls, "rest_ms": 1e3 * wall / steps - timed_ms}


def report(r: dict) -> None:
    print(f"\n{'fused layer' if r['fused'] else 'layer by layer'}: step {r['step_ms']:.2f} ms")
    for name, c in r["calls"].items():
        print(f"  {name:<44} {c['calls_per_step']:>6.0f}/step {c['us_per_call']:>9.1f} us {c['ms_per_step']:>7.2f} ms")
    print(f"  {'rest (Python, module calls, small torch ops)':<44} {'':>11} {'':>12} {r['rest_ms']:>7.2f} ms")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", default="default")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--cached", type=int, default=140)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--quick", action="store_true", help="10 steps")
    ap.add_argument("--results-dir", default=RESULTS)
    args = ap.parse_args()
    steps = 10 if args.quick else args.steps
    max_len = args.cached + 2
    runner = ModelRunner(ServerArgs(model_path=args.model_path, dtype=args.dtype, quantization=args.quantization,
                                    num_threads=args.num_threads, max_total_tokens=args.batch * max_len + 16,
                                    max_running_requests=args.batch, context_length=max(max_len, 1024)))
    batches = Batches(runner, max_len)
    instrument(runner)
    out = {"formats": str(runner.formats), "batch": args.batch, "cached": args.cached, "steps": steps,
           "runs": [measure(runner, batches, args.batch, args.cached, steps, f) for f in (False, True)]}
    for r in out["runs"]:
        report(r)
    os.makedirs(args.results_dir, exist_ok=True)
    with open(os.path.join(args.results_dir, "decode_step_calls.json"), "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
