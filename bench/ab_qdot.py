"""A/B of qdot.c against an older qdot.c (issue #19: first the T-blocking, each weight block
unpacked once for up to 4 activation rows, against 732eca7; then the fixed cost per call, no
malloc, a vectorized activation quantize, one thread for tiny jobs, against OLD_REV), in one
process, calls alternating (order flipping each pair), so both see the same machine load: the
median of the per-pair time ratios (new / old) means something even on a busy machine.

Revisions before b00799f read another weight layout (one row at a time, not groups of 8): given
this tree's buffers they compute other numbers in the same time, so only their timings mean
anything here.
"old" is qdot.c as of --old-rev (built from `git show`, with the current build flags) or the
file --old-source; where neither is there, the current source's "_one_row" build (one row per
pass, no blocking). --threads-ab instead times the new kernel on 1 thread against
--num-threads (what SERIAL_BYTES should say).
- kernels: SmolLM2-135M's projections (qkv 960x576, o 576x576, gate_up 3072x576, down
  576x1536 in int4; the 49152x576 head in int8; k/v alone, 192x576, for reference) at
  T = 1, 2, 4, 8, 9, 16 (9: a speculative verify step at batch 1 with 8 draft tokens);
- step: a whole forward of the embedded GGUF (int4 layers, int8 head, int8 activations) for one
  request with 128 cached tokens extending by T = 1 (decode) and T = 9 (verify), one runner,
  its layers bound to the old or the new kernel;
- probe (--probe): the format probe's timings (probe.measure) with each kernel, and the
  quant-vs-dense crossover `dense_rows` each gives.

    python bench/ab_qdot.py [--quick] [--num-threads 1] [--probe] [--old-rev REV | --old-source FILE]
        [--kernels-only] [--threads-ab]
Writes bench/results/ab_qdot[_threads]_t<threads>.json and .png.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from lmprog_runtime.config import ServerArgs  # noqa: E402  (before torch: sets OpenMP's wait policy)
import torch  # noqa: E402

from lmprog_runtime import native  # noqa: E402
from lmprog_runtime.model_executor import probe, qgemm  # noqa: E402
from lmprog_runtime.model_executor.quant import quantize_int4, quantize_int8  # noqa: E402

RESULTS = os.path.join(ROOT, "bench", "results")
OLD_REV = "e3c65bc"  # qdot.c before issue19a's fixed-cost cuts (732eca7: before the T-blocking)
SHAPES = [("qkv", "int4", 960, 576), ("k/v", "int4", 192, 576), ("o", "int4", 576, 576),
          ("gate_up", "int4", 3072, 576), ("down", "int4", 576, 1536), ("lm_head", "int8", 49152, 576)]
TS = (1, 2, 4, 8, 9, 16)


def old_kernel(rev: str, source: str = None):
    """({"int8": fn, "int4": fn} of the old qdot.c (the file `source`, else git's `rev`), a
    description); fn as qgemm.dot_fn's."""
    try:
        src = pathlib.Path(source).read_bytes() if source else subprocess.run(
            ["git", "-C", ROOT, "show", f"{rev}:lmprog_runtime/model_executor/qdot.c"],
            check=True, capture_output=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        src = None
    if source:
        rev = source
    lib = None
    if src:
        path = pathlib.Path(tempfile.mkdtemp(prefix="ab_qdot_")) / "qdot.c"
        path.write_bytes(src)
        lib = native.Kernel(path, native.NATIVE_FLAGS + qgemm._DOT_EXACT, True, qgemm._declare_dot).lib()
    if lib is None:
        fns = {f: qgemm.dot_fn(f, "native_one_row") for f in ("int8", "int4")}
        return fns, "current source, one row per pass (native_one_row)"
    return {"int8": lib.lm_q8x8_gemm, "int4": lib.lm_q4x8_gemm}, f"qdot.c at {rev}"


def call(fn, x, q, scales, threads=None):
    """dot_matmul's call with the C function `fn`: x float32 [T, K] -> y [T, N]."""
    y = torch.empty(x.shape[0], q.shape[0], dtype=torch.float32)
    if fn(x.data_ptr(), x.shape[0], x.shape[1], q.data_ptr(), scales.data_ptr(), q.shape[0], y.data_ptr(),
          threads or torch.get_num_threads()) != 0:
        raise MemoryError("qdot.c: no memory for the activation scratch")
    return y


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


def kernel_ab(old, pairs: int, threads_ab: bool = False):
    """old vs new per shape and T; with `threads_ab`, the new kernel on 1 thread ("old") vs on
    torch's thread count ("new"): what qdot.c's SERIAL_BYTES should say."""
    rows = []
    for name, fmt, n, k in SHAPES:
        w = torch.randn(n, k) * 0.05
        bufs = quantize_int8(w) if fmt == "int8" else qgemm.pack_q4_f16(*quantize_int4(w))
        new = qgemm.dot_fn(fmt)
        one = (new, 1) if threads_ab else (old[fmt], None)
        for T in TS:
            x = torch.randn(T, k)
            got = summary(interleaved(lambda: call(one[0], x, *bufs, threads=one[1]), lambda: call(new, x, *bufs),
                                      pairs))
            rows.append({"name": name, "fmt": fmt, "N": n, "K": k, "T": T, **got})
            print(f"{name:>8} {fmt} {n}x{k} T={T:<3} new/old {got['median_ratio_new_over_old']:.3f}")
    return rows


def int8_act_runner(threads=None):
    """A runner on the embedded GGUF, int4 layers, its probe replaced by 'int8 activations are
    fastest at every batch' (no dense crossover)."""
    from lmprog_runtime.model_executor.runner import ModelRunner

    real = probe.measure_cached
    probe.measure_cached = lambda config, formats: {
        f: {b: (0.5 if f[1] == "int8" else 1.0) * b for b in probe.PROBE_BATCHES} for f in formats}
    try:
        return ModelRunner(ServerArgs(model_path="default", dtype="float32", quantization="int4", num_threads=threads,
                                      max_total_tokens=2 * 200, max_running_requests=2, context_length=1024))
    finally:
        probe.measure_cached = real


def step_ab(old, pairs: int, threads=None):
    """Two runners, each bound to one kernel before its first step (a runner rebound between
    steps would keep the fused layer's first binding)."""
    from bench.one_batch import Batches

    new = {f: qgemm.dot_fn(f) for f in ("int8", "int4")}
    runners = {}
    for label, fns in (("old", old), ("new", new)):
        saved = dict(qgemm._C_FNS)
        qgemm._C_FNS.update({"int8x8": fns["int8"], "int4x8": fns["int4"]})
        try:
            runner = int8_act_runner(threads)
            assert runner.formats.act_dtype == torch.int8 and runner.formats.dense_rows is None
            batches = Batches(runner, 200)
            runner.forward(batches.make(1, 128, 1))  # binds the QuantLinears and the fused layer to fns
        finally:
            qgemm._C_FNS.clear()
            qgemm._C_FNS.update(saved)
        runners[label] = (runner, batches)
    out = {}
    for T in (1, 9):
        fbs = {label: b.make(1, 128, T) for label, (r, b) in runners.items()}
        out[T] = summary(interleaved(lambda: runners["old"][0].forward(fbs["old"]),
                                     lambda: runners["new"][0].forward(fbs["new"]), pairs))
        print(f"batch-1 forward, 128 cached + {T} new: new/old {out[T]['median_ratio_new_over_old']:.3f}")
    return out


def probe_ab(old, config):
    """probe.measure with each kernel -> {"old"|"new": {"seconds": ..., "dense_rows": ...}}."""
    formats = [("none", "float32"), ("int4", "int8")]
    out = {}
    for label, fns in (("old", old), ("new", {f: qgemm.dot_fn(f) for f in ("int8", "int4")})):
        saved = dict(qgemm._C_FNS)
        qgemm._C_FNS.update({"int8x8": fns["int8"], "int4x8": fns["int4"]})
        try:
            t = probe.measure(config, formats)
        finally:
            qgemm._C_FNS.clear()
            qgemm._C_FNS.update(saved)
        choice = probe.choose(t, require_quant=True)
        out[label] = {"seconds": {f"{w}/{d}": s for (w, d), s in t.items()}, "dense_rows": choice.dense_rows}
        print(f"probe with the {label} kernel: {probe.describe(t)} -> dense_rows={choice.dense_rows}")
    return out


def plot(rows, step, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 3.8))
    labels = [f"{r['name']}\nT={r['T']}" for r in rows] + [f"step\nT={T}" for T in step]
    ratios = [r["median_ratio_new_over_old"] for r in rows] + [s["median_ratio_new_over_old"] for s in step.values()]
    ax.bar(range(len(ratios)), ratios, color=["tab:blue"] * len(rows) + ["tab:green"] * len(step))
    ax.axhline(1.0, color="k", linewidth=0.8)
    ax.set_xticks(range(len(ratios)), labels, fontsize=5)
    ax.set_ylabel("time new / old (median of pairs)")
    ax.set_title("qdot.c: T-blocked (up to 4 / 8 activation rows per weight pass) vs the old one-row kernel")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=200)
    ap.add_argument("--quick", action="store_true", help="20 pairs")
    ap.add_argument("--num-threads", type=int, default=None, help="default: the runtime's (--num-threads)")
    ap.add_argument("--old-rev", default=OLD_REV, help="git revision of the old qdot.c")
    ap.add_argument("--old-source", default=None, help="the old qdot.c as a file (instead of --old-rev)")
    ap.add_argument("--probe", action="store_true", help="also run the format probe with each kernel")
    ap.add_argument("--kernels-only", action="store_true", help="no whole-forward A/B (no model needed)")
    ap.add_argument("--threads-ab", action="store_true",
                    help="the new kernel on 1 thread vs --num-threads (kernels only), not old vs new")
    ap.add_argument("--results-dir", default=RESULTS)
    args = ap.parse_args()
    if args.quick:
        args.pairs = 20
    if not qgemm.dot_available():
        sys.exit("qdot.c is not built here (no C compiler?)")
    old, old_desc = old_kernel(args.old_rev, args.old_source)
    if args.threads_ab:
        old_desc = "the new kernel on 1 thread"
    print("old kernel:", old_desc)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    step = {} if args.kernels_only or args.threads_ab else step_ab(old, args.pairs, args.num_threads)
    rows = kernel_ab(old, args.pairs, args.threads_ab)
    result = {"isa": qgemm.dot_isa(), "threads": torch.get_num_threads(), "pairs": args.pairs, "old": old_desc,
              "kernels": rows, "step_b1": {str(T): v for T, v in step.items()}}
    if args.probe:
        result["probe"] = probe_ab(old, int8_act_runner(args.num_threads).model_config)
    os.makedirs(args.results_dir, exist_ok=True)
    stem = os.path.join(args.results_dir, f"ab_qdot{'_threads' if args.threads_ab else ''}_t{torch.get_num_threads()}")
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=2)
    plot(rows, step, stem + ".png")


if __name__ == "__main__":
    main()
