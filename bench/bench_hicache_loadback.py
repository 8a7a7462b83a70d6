"""HiCache load-back latency: one big prefix loaded back from L2 into L1, whole
(`--hicache-io-backend direct`) or layer by layer overlapping the forward (`kernel`),
against recomputing it (HiCache off).

    python bench/bench_hicache_loadback.py            # 3,000-token prefix, 8 trials per mode
    python bench/bench_hicache_loadback.py --quick    # 1,500 tokens, 5 trials

Each trial: request A (the prefix + a question) after request B (another prefix of the same
size) pushed A's KV out of L1, so A's prefix comes back from L2 (or is recomputed with
HiCache off). Timed: A's time to first token (`max_new_tokens` 1), which is the load-back (or
the prefill of the prefix) plus the prefill of the question. L1 holds ~1.5 prefixes.
Writes bench/results/hicache_loadback.json (hicache_loadback_quick.json with --quick) and
a PNG. Timings are only meaningful on a quiet machine.
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
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.workloads import handbook  # noqa: E402

MODES = ("off", "direct", "kernel")  # recompute / whole load-back / layer-wise load-back


def engine_kwargs(mode: str, args, l1: int) -> dict:
    kw = dict(model_path=args.model_path, dtype=args.dtype, max_total_tokens=l1)
    if mode != "off":
        kw.update(enable_hierarchical_cache=True, hicache_ratio=4.0, hicache_io_backend=mode)
    return kw


def measure(mode: str, prompts, args, l1: int) -> dict:
    from lmprog_runtime import Engine

    a, b = prompts
    one = {"temperature": 0, "max_new_tokens": 1}
    ttfts, outputs = [], []
    with Engine(**engine_kwargs(mode, args, l1)) as engine:
        engine.generate("warm up the kernels", {"max_new_tokens": 4})
        engine.generate(a, one)  # A's prefix computed once (and, with HiCache, copied to L2)
        for _ in range(args.trials):
            engine.generate(b, one)  # B's prefix takes L1: A's goes to L2 (or away)
            t0 = time.perf_counter()
            out = engine.generate(a, one)
            ttfts.append(time.perf_counter() - t0)
            outputs.append(out["output_ids"])
        state = engine.get_internal_state()
        engine.check_integrity()
    return {"ttft_s": ttfts, "mean_ttft_s": statistics.mean(ttfts), "median_ttft_s": statistics.median(ttfts),
            "hit_tokens_l2": state.get("hicache_hit_tokens_l2", 0),
            "load_backs": state.get("hicache_load_back_count", 0),
            "prefill_tokens_per_s": state.get("hicache_prefill_tokens_per_s", 0.0),
            "l2_load_bytes_per_s": state.get("hicache_l2_load_bytes_per_s", 0.0), "outputs": outputs}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default="default")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--prefix-tokens", type=int, default=3000)
    ap.add_argument("--trials", type=int, default=8)
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, any of {', '.join(MODES)}")
    ap.add_argument("--quick", action="store_true", help="1,500-token prefix, 5 trials")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.prefix_tokens, args.trials = 1500, 5
    for m in args.modes.split(","):
        if m not in MODES:
            ap.error(f"--modes: expected some of {', '.join(MODES)}, got {m!r}")
    if args.out is None:
        name = "hicache_loadback_quick.json" if args.quick else "hicache_loadback.json"
        args.out = os.path.join(HERE, "results", name)
    return args


def main(argv=None):
    args = parse_args(argv)
    from lmprog_runtime.tokenizer import load_tokenizer

    docs = [handbook(args.prefix_tokens, seed=s) for s in (1, 2)]
    prompts = [d + "\n\nQuestion: what does section 3 say about travel?\nAnswer:" for d in docs]
    tok = load_tokenizer(args.model_path)
    sizes = [len(tok.encode(p)) for p in prompts]
    l1 = int(max(sizes) * 1.5) + 64
    results = {"config": {**vars(args), "prompt_tokens": sizes, "l1_tokens": l1}, "runs": {}}
    for mode in args.modes.split(","):
        print(f"{mode}: prefix ~{args.prefix_tokens} tokens, L1 {l1} tokens, {args.trials} trials ...", flush=True)
        r = results["runs"][mode] = measure(mode, prompts, args, l1)
        print(f"  mean TTFT {r['mean_ttft_s'] * 1000:.1f} ms (median {r['median_ttft_s'] * 1000:.1f}), "
              f"L2 hit tokens {r['hit_tokens_l2']}, load-backs {r['load_backs']}", flush=True)
    outs = {m: r.pop("outputs") for m, r in results["runs"].items()}
    results["identical_outputs"] = len({json.dumps(o) for o in outs.values()}) <= 1
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    plot(results, args.out.replace(".json", ".png"))
    print("identical greedy outputs across modes:", results["identical_outputs"])


def plot(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results["runs"]
    fig, ax = plt.subplots(figsize=(6, 4))
    names = list(runs)
    ax.bar(names, [runs[n]["mean_ttft_s"] * 1000 for n in names], color="tab:blue")
    for i, n in enumerate(names):
        ax.plot([i] * len(runs[n]["ttft_s"]), [t * 1000 for t in runs[n]["ttft_s"]], "k.", alpha=0.5)
    ax.set_ylabel("time to first token (ms)")
    cfg = results["config"]
    ax.set_title(f"Load-back of a {cfg['prompt_tokens'][0]}-token prompt: recompute / whole / layer-wise", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
