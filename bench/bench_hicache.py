"""HiCache: a document assistant whose documents do not fit in the device pool (L1).

    python bench/bench_hicache.py            # 32 documents x 8 questions, ~1,500 tokens each
    python bench/bench_hicache.py --quick    # 8 documents x 3 questions, ~600 tokens: minutes
    python bench/bench_hicache.py --modes l2,l2+l3   # only some configurations (any case)

Each of `--docs` distinct documents (~`--doc-tokens` tokens) gets `--questions` questions;
all requests in one random order, `--concurrency` in flight at a time, `--output-len`
greedy tokens each. L1 (`--max-total-tokens`) is sized to hold `--l1-docs` documents.
Three configurations, each on a fresh Engine:

    off      the radix cache alone (what L1 holds is all the reuse there is)
    L2       + the host tier: --hicache-ratio x L1 (default 3: 12 documents' worth, 4 of
             them copies of what L1 holds)
    L2+L3    + the `file` storage tier in a fresh temporary directory

Reported per configuration: request and token throughput, mean TTFT, and the share of
prompt tokens served from each tier (L1 / L2 / L3) and recomputed. Writes
bench/results/hicache.json and hicache.png; a run of some modes replaces those modes in an
existing JSON of the same workload and keeps the others (so modes can be run one at a
time). Timings are only meaningful on a quiet machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.workloads import handbook, questions  # noqa: E402

CONFIGS = ("off", "L2", "L2+L3")


def build_prompts(args):
    rng = random.Random(args.seed)
    docs = [handbook(args.doc_tokens, seed=1000 + d).replace("Employee Handbook.", f"Handbook {d}.")
            for d in range(args.docs)]
    prompts = [doc + "\n\nQuestion: " + q + "\nAnswer:" for doc in docs
               for q in questions(args.questions, rng)]
    rng.shuffle(prompts)
    return docs, prompts


def l1_tokens(args, docs) -> int:
    """KV slots for `--l1-docs` documents plus the running requests' outputs."""
    if args.max_total_tokens:
        return args.max_total_tokens
    from lmprog_runtime.tokenizer import load_tokenizer
    tok = load_tokenizer(args.model_path)
    per_doc = max(len(tok.encode(d)) for d in docs) + 32
    return args.l1_docs * per_doc + args.concurrency * (args.output_len + 32)


async def run_requests(engine, prompts, args) -> dict:
    params = {"temperature": 0, "max_new_tokens": args.output_len, "ignore_eos": True}
    gate = asyncio.Semaphore(args.concurrency)
    ttfts, out_tokens, prompt_tokens, cached = [], 0, 0, 0

    async def one(prompt):
        nonlocal out_tokens, prompt_tokens, cached
        async with gate:
            t0, first, last = time.perf_counter(), None, None
            async for chunk in await engine.async_generate(prompt, params, stream=True):
                if first is None and chunk["output_ids"]:
                    first = time.perf_counter() - t0
                last = chunk
            ttfts.append(first)
            meta = last["meta_info"]
            out_tokens += meta["completion_tokens"]
            prompt_tokens += meta["prompt_tokens"]
            cached += meta["cached_tokens"]

    t0 = time.perf_counter()
    await asyncio.gather(*(one(p) for p in prompts))
    wall = time.perf_counter() - t0
    return {"requests": len(prompts), "wall_s": wall, "request_throughput": len(prompts) / wall,
            "total_token_throughput": (prompt_tokens + out_tokens) / wall,
            "mean_ttft_s": statistics.mean(ttfts), "median_ttft_s": statistics.median(ttfts),
            "prompt_tokens": prompt_tokens, "cached_tokens": cached}


def engine_kwargs(name: str, args, l1: int, storage_dir: str) -> dict:
    kw = dict(model_path=args.model_path, dtype=args.dtype, max_total_tokens=l1,
              schedule_policy=args.policy)
    if name != "off":
        kw.update(enable_hierarchical_cache=True, hicache_ratio=args.hicache_ratio,
                  hicache_write_policy=args.write_policy)
    if name == "L2+L3":
        kw.update(hicache_storage_backend="file", hicache_storage_dir=storage_dir,
                  hicache_storage_prefetch_policy=args.prefetch_policy)
    return kw


def measure(name: str, prompts, args, l1: int) -> dict:
    from lmprog_runtime import Engine

    with tempfile.TemporaryDirectory(prefix="hicache-bench-") as storage_dir, \
            Engine(**engine_kwargs(name, args, l1, storage_dir)) as engine:
        engine.generate("warm up the kernels", {"max_new_tokens": 4})  # not timed
        engine.flush_cache()
        result = asyncio.run(run_requests(engine, prompts, args))
        state = engine.get_internal_state()
        engine.check_integrity()
    total = result["prompt_tokens"]
    tiers = {"L1": state.get("hicache_hit_tokens_l1", result["cached_tokens"]),
             "L2": state.get("hicache_hit_tokens_l2", 0), "L3": state.get("hicache_hit_tokens_l3", 0)}
    result["hit_rate"] = {t: n / total for t, n in tiers.items()}
    result["hit_rate"]["recomputed"] = 1 - result["cached_tokens"] / total
    result["bytes"] = {k: state.get(k, 0) for k in ("l2_write_bytes", "l2_load_bytes", "l3_write_bytes",
                                                      "l3_read_bytes")}
    result["cost_model"] = {k: state.get(k, 0) for k in ("hicache_prefill_tokens_per_s",
                                                           "hicache_l2_load_bytes_per_s",
                                                           "hicache_decisions_load",
                                                           "hicache_decisions_recompute")}
    return result


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default="default")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--docs", type=int, default=32)
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--doc-tokens", type=int, default=1500)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--l1-docs", type=int, default=4)
    ap.add_argument("--max-total-tokens", type=int, default=None, help="L1 size; default: --l1-docs documents")
    ap.add_argument("--hicache-ratio", type=float, default=None,
                    help="L2 / L1; default 3 (1.5 with --quick, so that L3 has documents to serve)")
    ap.add_argument("--write-policy", default="write_through")
    ap.add_argument("--prefetch-policy", default="timeout")
    ap.add_argument("--policy", default="lpm")
    ap.add_argument("--modes", "--configs", dest="configs", default=",".join(CONFIGS),
                    help=f"comma-separated, any of {', '.join(CONFIGS)} (case-insensitive)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="8 documents x 3 questions, ~600 tokens each")
    ap.add_argument("--out", default=None,
                    help="default bench/results/hicache.json (hicache_quick.json with --quick)")
    args = ap.parse_args(argv)
    if args.quick:
        args.docs, args.questions, args.doc_tokens, args.output_len = 8, 3, 600, 8
    if args.hicache_ratio is None:
        args.hicache_ratio = 1.5 if args.quick else 3.0
    args.configs = ",".join(_mode(m, ap) for m in args.configs.split(","))
    if args.out is None:
        args.out = os.path.join(HERE, "results", "hicache_quick.json" if args.quick else "hicache.json")
    return args


def _mode(name: str, ap) -> str:
    by_lower = {c.lower(): c for c in CONFIGS}
    if name.strip().lower() not in by_lower:
        ap.error(f"--modes: expected some of {', '.join(CONFIGS)}, got {name!r}")
    return by_lower[name.strip().lower()]


def _previous_runs(path: str, config: dict) -> dict:
    """The runs of an earlier result file for the same workload (all but the modes agree)."""
    try:
        with open(path) as f:
            old = json.load(f)
    except (OSError, ValueError):
        return {}
    same = {k: v for k, v in old.get("config", {}).items() if k != "configs"} == \
        {k: v for k, v in config.items() if k != "configs"}
    return old.get("runs", {}) if same else {}


def main(argv=None):
    args = parse_args(argv)
    docs, prompts = build_prompts(args)
    l1 = l1_tokens(args, docs)
    config = {**vars(args), "l1_tokens": l1}
    results = {"config": config, "runs": _previous_runs(args.out, config)}
    for name in args.configs.split(","):
        print(f"{name}: {len(prompts)} requests over {len(docs)} documents, L1 {l1} tokens ...", flush=True)
        results["runs"][name] = measure(name, prompts, args, l1)
        print(json.dumps(results["runs"][name], indent=1), flush=True)
    runs = results["runs"] = {n: results["runs"][n] for n in CONFIGS if n in results["runs"]}
    if "off" in runs:
        for name in runs:
            runs[name]["throughput_vs_off"] = runs[name]["request_throughput"] / runs["off"]["request_throughput"]
            runs[name]["ttft_vs_off"] = runs[name]["mean_ttft_s"] / runs["off"]["mean_ttft_s"]
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    plot(results, args.out.replace(".json", ".png"))
    for name, r in runs.items():
        rates = " ".join(f"{t} {v:.0%}" for t, v in r["hit_rate"].items())
        print(f"{name:6s} {r['request_throughput']:.2f} req/s, mean TTFT {r['mean_ttft_s'] * 1000:.0f} ms, {rates}")


def plot(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results["runs"]
    names = list(runs)
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    axes[0].bar(names, [runs[n]["request_throughput"] for n in names], color="tab:green")
    axes[0].set_ylabel("requests/s")
    axes[1].bar(names, [runs[n]["mean_ttft_s"] for n in names], color="tab:blue")
    axes[1].set_ylabel("mean TTFT (s)")
    bottom = [0.0] * len(names)
    for tier, color in (("L1", "tab:green"), ("L2", "tab:orange"), ("L3", "tab:purple"),
                        ("recomputed", "tab:gray")):
        values = [runs[n]["hit_rate"][tier] for n in names]
        axes[2].bar(names, values, bottom=bottom, label=tier, color=color)
        bottom = [b + v for b, v in zip(bottom, values)]
    axes[2].set_ylabel("share of prompt tokens")
    axes[2].legend(fontsize=8)
    cfg = results["config"]
    fig.suptitle(f"HiCache: {cfg['docs']} documents x {cfg['questions']} questions, "
                 f"L1 {cfg['l1_tokens']} tokens (~{cfg['l1_docs']} documents)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
