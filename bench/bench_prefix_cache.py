"""Prefix reuse through the Engine: a "document assistant" workload with the radix cache
on vs off, and a workload with no sharing at all (the cache's overhead).

    python bench/bench_prefix_cache.py                      # SmolLM2, 64 requests
    python bench/bench_prefix_cache.py --num-requests 16    # quicker

Document assistant: one ~1,500-token handbook shared by every request, each with its
own question, 32 output tokens, all submitted at once. No-sharing: distinct random
prompts of similar total size. Writes bench/results/prefix_cache.json and a PNG.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

from tqdm import tqdm

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.workloads import handbook, questions, random_prompts  # noqa: E402


def run_workload(engine, prompts, max_new_tokens: int) -> dict:
    """Submit all prompts at once (streaming, to time the first token of each)."""
    import asyncio

    params = {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True}
    ttfts, e2es, out_tokens, cached, prompt_tokens = [], [], 0, 0, 0
    bar = tqdm(total=len(prompts), desc="requests", leave=False)

    async def one(prompt):
        nonlocal out_tokens, cached, prompt_tokens
        t0 = time.perf_counter()
        first = None
        last = None
        async for chunk in await engine.async_generate(prompt, params, stream=True):
            if first is None and chunk["output_ids"]:
                first = time.perf_counter() - t0
            last = chunk
        e2es.append(time.perf_counter() - t0)
        ttfts.append(first)
        meta = last["meta_info"]
        out_tokens += meta["completion_tokens"]
        cached += meta["cached_tokens"]
        prompt_tokens += meta["prompt_tokens"]
        bar.update(1)

    async def main():
        await asyncio.gather(*(one(p) for p in prompts))

    t0 = time.perf_counter()
    asyncio.run(main())
    wall = time.perf_counter() - t0
    bar.close()
    return {
        "requests": len(prompts), "wall_s": wall,
        "request_throughput": len(prompts) / wall,
        "output_throughput": out_tokens / wall,
        "total_token_throughput": (prompt_tokens + out_tokens) / wall,
        "mean_ttft_s": statistics.mean(ttfts), "median_ttft_s": statistics.median(ttfts),
        "mean_e2e_s": statistics.mean(e2es),
        "prompt_tokens": prompt_tokens, "cached_tokens": cached,
        "hit_rate": cached / prompt_tokens if prompt_tokens else 0.0,
    }


def measure(model_path, cache_on: bool, prompts, args) -> dict:
    from lmprog_runtime import Engine

    with Engine(model_path=model_path, dtype=args.dtype, disable_radix_cache=not cache_on,
                schedule_policy=args.policy, max_total_tokens=args.max_total_tokens,
                disable_overlap_schedule=args.disable_overlap,
                force_overlap_schedule=getattr(args, "force_overlap", False)) as engine:
        engine.generate("warm up the kernels", {"max_new_tokens": 4})  # not timed
        engine.flush_cache()
        result = run_workload(engine, prompts, args.output_len)
        state = engine.get_internal_state()
        result["scheduler_share"] = 1 - state["forward_s"] / state["step_s"] if state["step_s"] else 0.0
        engine.check_integrity()
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default="default")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--doc-tokens", type=int, default=1500)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--policy", default="lpm")
    ap.add_argument("--max-total-tokens", type=int, default=None)
    ap.add_argument("--disable-overlap", action="store_true")
    ap.add_argument("--skip-no-sharing", action="store_true")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "prefix_cache.json"))
    args = ap.parse_args()

    rng = random.Random(0)
    doc = handbook(args.doc_tokens)
    shared = [doc + "\n\nQuestion: " + q + "\nAnswer:" for q in questions(args.num_requests, rng)]
    results = {"config": vars(args), "document_assistant": {}, "no_sharing": {}}
    for cache_on in (True, False):
        key = "cache_on" if cache_on else "cache_off"
        print(f"document assistant, {key} ...", flush=True)
        results["document_assistant"][key] = measure(args.model_path, cache_on, shared, args)
        print(json.dumps(results["document_assistant"][key], indent=1), flush=True)
    da = results["document_assistant"]
    da["throughput_ratio"] = da["cache_on"]["request_throughput"] / da["cache_off"]["request_throughput"]
    da["ttft_ratio"] = da["cache_off"]["mean_ttft_s"] / da["cache_on"]["mean_ttft_s"]

    if not args.skip_no_sharing:
        distinct = random_prompts(args.num_requests, 200, rng)
        for cache_on in (True, False):
            key = "cache_on" if cache_on else "cache_off"
            print(f"no sharing, {key} ...", flush=True)
            results["no_sharing"][key] = measure(args.model_path, cache_on, distinct, args)
        ns = results["no_sharing"]
        ns["overhead"] = 1 - ns["cache_on"]["request_throughput"] / ns["cache_off"]["request_throughput"]

    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    plot(results, args.out.replace(".json", ".png"))
    print(f"\ndocument assistant: throughput x{da['throughput_ratio']:.2f} with the cache, "
          f"TTFT x{da['ttft_ratio']:.2f} lower, hit rate {da['cache_on']['hit_rate']:.1%}")
    if results["no_sharing"]:
        print(f"no sharing: cache overhead {results['no_sharing']['overhead']:+.2%}")


def plot(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, metric, label in ((axes[0], "request_throughput", "requests/s"), (axes[1], "mean_ttft_s", "mean TTFT (s)")):
        names, values = [], []
        for workload in ("document_assistant", "no_sharing"):
            for key in ("cache_on", "cache_off"):
                if key in results[workload]:
                    names.append(f"{workload.replace('_', ' ')}\n{key.replace('_', ' ')}")
                    values.append(results[workload][key][metric])
        ax.bar(names, values, color=["tab:green", "tab:gray"] * 2)
        ax.set_ylabel(label)
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle("RadixAttention prefix reuse (lmprog Engine, SmolLM2-135M, CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
