"""Where a batch-1 decode step goes: torch.profiler's self-CPU time per op group, plus the
step's wall time with no profiler, for one `--dtype` (the runner's formats as `--dtype auto`
would pick them). Ratios only on a busy machine: compare groups, not absolute milliseconds.

    python bench/profile_decode_step.py --dtype auto --cached 128
    python bench/profile_decode_step.py --dtype float32 --quick
Writes bench/results/profile_decode_step_<dtype>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lmprog_runtime.config import ServerArgs  # noqa: E402  (before torch: sets OpenMP's wait policy)

from bench.one_batch import Batches, RESULTS  # noqa: E402
from lmprog_runtime.model_executor.runner import ModelRunner  # noqa: E402

# op-name substrings -> group (first match wins); the rest is "other"
GROUPS = [
    ("quantized matmul", ("_weight_int4pack", "_weight_int8pack")),
    ("dense matmul", ("aten::mm", "aten::addmm", "aten::linear", "aten::matmul")),
    ("dtype casts / copies", ("aten::to", "aten::_to_copy", "aten::copy_", "aten::contiguous", "aten::clone")),
    ("kv write", ("index_copy",)),
    ("elementwise (rope, silu*mul, residual)", ("aten::mul", "aten::add", "aten::silu", "aten::cat", "aten::neg")),
    ("norms", ("rms_norm", "aten::pow", "aten::mean", "aten::rsqrt")),
    ("views / slicing / alloc", ("aten::view", "aten::slice", "aten::split", "aten::narrow", "aten::select",
                                 "aten::empty", "aten::reshape", "aten::as_strided", "aten::transpose",
                                 "aten::expand", "aten::unsqueeze", "aten::t", "aten::_unsafe_view",
                                 "aten::detach", "aten::alias", "aten::resolve")),
    ("indexing / embedding", ("aten::index", "aten::embedding", "aten::gather")),
]


def group_of(name: str) -> str:
    for group, keys in GROUPS:
        if any(k in name for k in keys):
            return group
    return "other"


def profile_step(runner, fb_fn, steps: int):
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        runner.forward(fb_fn())
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            runner.forward(fb_fn())
    profiled_ms = 1e3 * (time.perf_counter() - t0) / steps
    groups, calls = defaultdict(float), defaultdict(int)
    for ev in prof.key_averages():
        # top-level aten ops only: self time, so nested ops are not counted twice
        groups[group_of(ev.key)] += ev.self_cpu_time_total / steps / 1e3
        calls[group_of(ev.key)] += ev.count // steps
    # what no torch op accounts for: the C kernels called through ctypes, and Python itself
    groups["outside torch ops (ctypes C kernels, Python)"] = max(0.0, profiled_ms - sum(groups.values()))
    return dict(groups), dict(calls), sum(ev.count for ev in prof.key_averages()) // steps


class Timers:
    """Manual timers around the step's kernels (works on any revision: it patches by name):
    the projections (`QuantLinear.forward`, `F.linear`, casts included; nested calls counted once),
    the paged attention kernel (the `lm_paged_decode` C call) and, where the model runs the fused
    quantized layer (llama_layer.py), its per-layer C calls (`lm_layer_head` / `lm_layer_tail`:
    the projections, norms, rope and K/V writes of a layer). A fused step is timed layer by layer
    (`WHOLE_STEP` off while the timers are on: the one-call step has nothing to time between).
    The rest of a step is everything else: bookkeeping, Python, the torch ops left."""

    def __init__(self, model=None):
        import torch.nn.functional as F
        from lmprog_runtime.attention import paged_decode
        from lmprog_runtime.model_executor import quant

        self.ms = defaultdict(float)
        self.depth = 0
        self._undo = []
        self._wrap(quant.QuantLinear, "forward", "matmuls")
        self._wrap(F, "linear", "matmuls")
        lib = paged_decode._KERNEL.lib()
        if lib is not None:
            self._wrap(lib, "lm_paged_decode", "attention kernel")
        try:
            from lmprog_runtime.model_executor import llama_layer
        except ImportError:  # a revision without the fused layer
            return
        if hasattr(llama_layer, "WHOLE_STEP"):
            self._undo.append((llama_layer, "WHOLE_STEP", llama_layer.WHOLE_STEP))
            llama_layer.WHOLE_STEP = False
        fused = getattr(model, "_fused_layers", None)  # made by the model's first fused step
        if fused:
            group = "fused layer C calls (projections, norms, rope, K/V write)"
            self._wrap(fused, "head", group)
            self._wrap(fused, "tail", group)

    def _wrap(self, owner, name: str, group: str) -> None:
        inner = getattr(owner, name)

        def timed(*a, **kw):
            if self.depth:
                return inner(*a, **kw)
            self.depth += 1
            t0 = time.perf_counter()
            try:
                return inner(*a, **kw)
            finally:
                self.ms[group] += 1e3 * (time.perf_counter() - t0)
                self.depth -= 1

        setattr(owner, name, timed)
        self._undo.append((owner, name, inner))

    def close(self) -> None:
        for owner, name, inner in reversed(self._undo):
            setattr(owner, name, inner)


def timed_groups(runner, fb_fn, steps: int) -> dict:
    """Per-step ms of the matmuls, the attention kernel and the rest (manual timers)."""
    timers = Timers(runner.model)
    try:
        t0 = time.perf_counter()
        for _ in range(steps):
            runner.forward(fb_fn())
        total = 1e3 * (time.perf_counter() - t0) / steps
    finally:
        timers.close()
    out = {g: v / steps for g, v in timers.ms.items()}
    out["rest (bookkeeping, Python, other torch ops)"] = total - sum(out.values())
    return {"step_ms": total, **out}


def wall_ms(runner, fb_fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        fb = fb_fn()
        t0 = time.perf_counter()
        runner.forward(fb)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", default="default")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--cached", type=int, default=128, help="tokens already in the KV cache")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--results-dir", default=RESULTS)
    args = ap.parse_args()
    steps = 4 if args.quick else args.steps
    runner = ModelRunner(ServerArgs(model_path=args.model_path, dtype=args.dtype, quantization=args.quantization,
                                    num_threads=args.num_threads,
                                    max_total_tokens=4 * (args.cached + 8) + 16, max_running_requests=2,
                                    context_length=max(args.cached + 8, 1024)))
    batches = Batches(runner, args.cached + 8)
    fb_fn = lambda: batches.make(1, args.cached, 1)  # noqa: E731
    ms = wall_ms(runner, fb_fn, 3 * steps)
    timed = timed_groups(runner, fb_fn, 3 * steps)
    groups, calls, n_ops = profile_step(runner, fb_fn, steps)
    total = sum(groups.values())
    result = {"dtype": args.dtype, "formats": str(runner.formats), "step_wall_ms": ms, "ops_per_step": n_ops,
              "timed_ms": timed, "timed_share": {g: v / timed["step_ms"] for g, v in timed.items() if g != "step_ms"},
              "groups_ms": groups, "groups_share": {g: v / total for g, v in groups.items()}, "calls": calls}
    print(f"{runner.formats}\nstep {ms:.2f} ms (wall, median), {n_ops} profiled ops per step")
    print(f"manual timers (step {timed['step_ms']:.2f} ms with timers):")
    for g, v in result["timed_share"].items():
        print(f"  {g:62s} {100 * v:5.1f}%")
    print("torch.profiler self time:")
    for g, v in sorted(groups.items(), key=lambda kv: -kv[1]):
        print(f"  {g:46s} {100 * v / total:5.1f}%  {calls.get(g, 0):4d} calls")
    os.makedirs(args.results_dir, exist_ok=True)
    with open(os.path.join(args.results_dir, f"profile_decode_step_{args.dtype}.json"), "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
