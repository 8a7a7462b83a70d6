"""A/B of the paged decode kernel (attention/paged_decode.c) against its source on `main` (issue
#19: a one-thread path for small work, no merge pass for one part, one parallel region,
vectorized q.k / p.v / exp), in one process, calls alternating (order flipping each pair), so
both see the same machine load: the median of the per-pair time ratios (new / old) means
something even on a busy machine. Both builds get the same arguments (PagedDecodePlan.c_args).

Cases: SmolLM2-135M's attention (9 heads, 3 kv heads, head_dim 64, float32 K/V; --bf16 for
bfloat16), keys 16, 140, 512, 1700 per request, batch 1 and 8, with no shared prefix and with
one (every request's first keys - 16 positions shared: the cascade path; keys 16: 8 shared).

    python bench/ab_paged_decode.py [--quick] [--num-threads N] [--old-rev REV | --old-source FILE] [--bf16]
        [--threads-ab | --kv-ab]
--threads-ab: the new kernel on 1 thread vs --num-threads; --kv-ab: the new kernel on float32
K/V vs the same values in bfloat16 over 30 layers' pools in turn, as a decode step reads them
(the doc assistant's question: B 8, keys 1700, prefix 1684; us are then per step).
Writes bench/results/ab_paged_decode[_threads|_kv][_bf16]_t<threads>.json and .png.
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import lmprog_runtime.config  # noqa: E402,F401  (before torch: sets OpenMP's wait policy)
import torch  # noqa: E402

from lmprog_runtime import native  # noqa: E402
from lmprog_runtime.attention import paged_decode as pd  # noqa: E402

RESULTS = os.path.join(ROOT, "bench", "results")
H, KV, D = 9, 3, 64
KEYS, BATCHES = (16, 140, 512, 1700), (1, 8)
OLD_REV = "e3c65bc"  # paged_decode.c before issue19a's work
LAYERS = 30  # --kv-ab times a step's worth of layers (SmolLM2's 30), each with its own K/V


def old_kernel(rev: str, source: str = None):
    """(lm_paged_decode of the old paged_decode.c: the file `source`, else git's `rev`, a
    description), or (None, why)."""
    try:
        src = pathlib.Path(source).read_bytes() if source else subprocess.run(
            ["git", "-C", ROOT, "show", f"{rev}:lmprog_runtime/attention/paged_decode.c"],
            check=True, capture_output=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"no source at {rev}: {exc}"
    rev = source or rev
    path = pathlib.Path(tempfile.mkdtemp(prefix="ab_pd_")) / "paged_decode.c"
    path.write_bytes(src)
    lib = native.Kernel(path, native.NATIVE_FLAGS, True, pd._declare).lib()
    return (lib.lm_paged_decode if lib else None), f"paged_decode.c at {rev}"


def case(B: int, keys: int, shared: bool, bf16: bool, layers: int = 0):
    """(plan, q, k, v): B requests of `keys` keys on scattered slots, the first ones shared if
    `shared`; with `layers`, k and v are [layers, slots, KV, D] (one pool per layer, as a step
    reads them: more K/V than the caches hold)."""
    g = torch.Generator().manual_seed(B * 10007 + keys)
    slots = B * keys + 64
    dtype = torch.bfloat16 if bf16 else torch.float32
    shape = (layers, slots, KV, D) if layers else (slots, KV, D)
    k, v = (torch.randn(shape, generator=g).to(dtype) for _ in range(2))
    table = torch.randperm(slots - 1, generator=g)[:B * keys].view(B, keys) + 1
    P = (keys - 16 if keys > 16 else 8) if shared else 0
    prefix = None
    if P:
        prefix = table[0, :P].clone()
        table[:, :P] = prefix
    rows, seq_lens = torch.arange(B), torch.full((B,), keys)
    plan = pd.PagedDecodePlan(table.contiguous(), rows, seq_lens, D ** -0.5, H, KV, D, bf16, prefix, keys)
    return plan, torch.randn(B, H, D, generator=g), k, v


def interleaved(old, new, pairs: int):
    """(old s, new s) per pair, back to back, order alternating; after warm-up calls."""
    for _ in range(3):
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


def run_ab(old_fn, pairs: int, bf16: bool, mode: str = "old", layers_arg: int = 0):
    """Per case, old vs new: mode "old" the build at --old-rev vs this one; "threads" this one
    on 1 thread vs on torch's thread count (what paged_decode.c's SERIAL_WORK should say); "kv"
    this one on float32 K/V vs on the same values in bfloat16 (half the bytes read)."""
    new_fn = pd._KERNEL.lib().lm_paged_decode
    rows = []
    for shared in (False, True):
        for B in BATCHES:
            for keys in KEYS:
                layers = LAYERS if mode == "kv" else layers_arg
                plan, q, k, v = case(B, keys, shared, bf16 and mode != "kv", layers)
                o_old, o_new = torch.empty_like(q), torch.empty_like(q)
                if mode == "kv" or layers:  # a step: every layer's pool once
                    plan_b, q_b, k_b, v_b = case(B, keys, shared, True, layers) if mode == "kv" else (plan, q, k, v)
                    a_old = [plan.c_args(q, k[i], v[i], o_old) for i in range(layers)]
                    a_new = [plan_b.c_args(q_b, k_b[i], v_b[i], o_new) for i in range(layers)]
                else:
                    a_old, a_new = [plan.c_args(q, k, v, o_old)], [plan.c_args(q, k, v, o_new)]
                if mode == "threads":
                    a_old = [a[:16] + (1,) + a[17:] for a in a_old]  # nthreads
                t = interleaved(lambda: [old_fn(*a) for a in a_old], lambda: [new_fn(*a) for a in a_new], pairs)
                err = (o_old - o_new).abs().max().item()
                r = {"B": B, "keys": keys, "prefix": plan.P, "max_abs_diff": err,
                     "median_ratio_new_over_old": statistics.median(n / o for o, n in t),
                     "old_median_us": 1e6 * statistics.median(o for o, _ in t),
                     "new_median_us": 1e6 * statistics.median(n for _, n in t)}
                rows.append(r)
                print(f"B={B} keys={keys:<5} prefix={plan.P:<5} new/old {r['median_ratio_new_over_old']:.3f} "
                      f"({r['old_median_us']:.1f} -> {r['new_median_us']:.1f} us, |diff| {err:.1e})")
    return rows


def plot(rows, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 3.6))
    labels = [f"B{r['B']} {r['keys']}\n{'P' + str(r['prefix']) if r['prefix'] else 'no pfx'}" for r in rows]
    ax.bar(range(len(rows)), [r["median_ratio_new_over_old"] for r in rows],
           color=["tab:orange" if r["prefix"] else "tab:blue" for r in rows])
    ax.axhline(1.0, color="k", linewidth=0.8)
    ax.set_xticks(range(len(rows)), labels, fontsize=6)
    ax.set_ylabel("time new / old (median of pairs)")
    ax.set_title("paged_decode.c: new vs main (SmolLM2 heads; blue no prefix, orange shared prefix)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=300)
    ap.add_argument("--quick", action="store_true", help="30 pairs")
    ap.add_argument("--num-threads", type=int, default=None, help="default: torch's")
    ap.add_argument("--old-rev", default=OLD_REV, help="git revision of the old paged_decode.c")
    ap.add_argument("--old-source", default=None, help="the old paged_decode.c as a file (instead of --old-rev)")
    ap.add_argument("--threads-ab", action="store_true", help="the new kernel on 1 thread vs --num-threads")
    ap.add_argument("--kv-ab", action="store_true", help="the new kernel on float32 K/V vs bfloat16 K/V")
    ap.add_argument("--layers", type=int, default=0,
                    help="time a step: this many layers, each its own K/V pool (--kv-ab: 30)")
    ap.add_argument("--bf16", action="store_true", help="bfloat16 K/V (default float32)")
    ap.add_argument("--results-dir", default=RESULTS)
    args = ap.parse_args()
    if args.quick:
        args.pairs = 30
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    if not pd.available():
        sys.exit("paged_decode.c is not built here (no C compiler?)")
    old_fn, old_desc = old_kernel(args.old_rev, args.old_source)
    mode = "threads" if args.threads_ab else ("kv" if args.kv_ab else "old")
    if mode != "old":
        old_fn = pd._KERNEL.lib().lm_paged_decode
        old_desc = "the new kernel on 1 thread" if mode == "threads" else "the new kernel on float32 K/V (new: bf16)"
    if old_fn is None:
        sys.exit(old_desc)
    print("old kernel:", old_desc, "| threads:", torch.get_num_threads())
    rows = run_ab(old_fn, args.pairs, args.bf16, mode, args.layers)
    os.makedirs(args.results_dir, exist_ok=True)
    tag = {"old": "", "threads": "_threads", "kv": "_kv"}[mode] + ("_bf16" if args.bf16 and mode != "kv" else "")
    stem = os.path.join(args.results_dir, f"ab_paged_decode{tag}_t{torch.get_num_threads()}")
    with open(stem + ".json", "w") as f:
        json.dump({"threads": torch.get_num_threads(), "pairs": args.pairs, "old": old_desc, "kv_bf16": args.bf16,
                   "heads": H, "kv_heads": KV, "head_dim": D, "cases": rows}, f, indent=2)
    plot(rows, stem + ".png")


if __name__ == "__main__":
    main()
