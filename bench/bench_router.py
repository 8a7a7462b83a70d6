"""Data-parallel replicas behind SGLang's router: cache_aware vs round_robin routing.

    python bench/bench_router.py            # 8 documents (~1,500 tokens) x 8 questions, 8 clients
    python bench/bench_router.py --quick    # 2 documents (~300 tokens) x 3 questions: a smoke run

Two lmprog servers on SmolLM2 (`--dp-size 1`, `--num-threads 1` each: one core each on a
two-core machine) behind the real `sglang-router` (`python -m sglang_router.launch_router`),
once with `--policy cache_aware` and once with `--policy round_robin`; then, for comparison,
one lmprog server with `--dp-size 2` (the same two replicas, balanced in-process with
`round_robin`) without the router. The workload is every (document, question) pair in a
random order: a prompt is `document + question`, so a replica that has a document's KV
cached answers its later questions from the radix cache. Per configuration: requests/s,
prefix hit rate (sum of cached_tokens / sum of prompt tokens, from the responses), mean and
median TTFT. Results: bench/results/router.json (router_quick.json with --quick) + a PNG.
Each configuration starts from empty caches (the workers' /flush_cache).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from bench.baselines.servers import LmprogServer, SglangRouter  # noqa: E402
from bench.workloads import handbook, questions  # noqa: E402


def build_prompts(args):
    rng = random.Random(args.seed)
    docs = [handbook(args.doc_tokens, seed=2000 + d).replace("Employee Handbook.", f"Handbook {d}.")
            for d in range(args.docs)]
    prompts = [doc + "\n\nQuestion: " + q + "\nAnswer:" for doc in docs for q in questions(args.questions, rng)]
    rng.shuffle(prompts)
    return prompts


async def run_requests(url: str, prompts, args) -> dict:
    """Stream every prompt through `url` with `args.clients` concurrent clients."""
    import aiohttp

    params = {"temperature": 0, "max_new_tokens": args.output_len, "ignore_eos": True}
    gate = asyncio.Semaphore(args.clients)
    ttfts, metas = [], []

    async def one(session, prompt):
        async with gate:
            t0, first, last = time.perf_counter(), None, None
            async with session.post(url + "/generate", json={"text": prompt, "stream": True,
                                                              "sampling_params": params}) as resp:
                resp.raise_for_status()
                async for raw in resp.content:
                    line = raw.decode().strip()
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if first is None and chunk.get("output_ids"):
                        first = time.perf_counter() - t0
                    last = chunk
            ttfts.append(first)
            metas.append(last["meta_info"])

    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(session, p) for p in prompts))
        wall = time.perf_counter() - t0
    prompt_tokens = sum(m["prompt_tokens"] for m in metas)
    cached = sum(m["cached_tokens"] for m in metas)
    return {"requests": len(prompts), "wall_s": wall, "request_throughput": len(prompts) / wall,
            "hit_rate": cached / prompt_tokens, "prompt_tokens": prompt_tokens, "cached_tokens": cached,
            "mean_ttft_s": statistics.mean(ttfts), "median_ttft_s": statistics.median(ttfts)}


def _flush(urls) -> None:
    import requests

    for url in urls:
        requests.post(url + "/flush_cache", timeout=60).raise_for_status()


def _warm(url: str) -> None:
    import requests

    requests.post(url + "/generate", timeout=600, json={"text": "warm up", "sampling_params": {
        "max_new_tokens": 2}}).raise_for_status()


def server_args(args, threads: int):
    return ["--num-threads", str(threads), "--max-total-tokens", str(args.max_total_tokens),
            "--host", "127.0.0.1"]


def measure_router(prompts, args, port: int) -> dict:
    """Two --dp-size 1 servers, then the router in front of them once per policy."""
    runs = {}
    workers = [LmprogServer(port + 1 + i, model_path=args.model_path, extra_args=server_args(args, 1),
                            log_path=os.path.join(args.log_dir, f"router-worker{i}.log")) for i in range(2)]
    urls = [w.__enter__() for w in workers]
    try:
        for url in urls:
            _warm(url)
        for policy in args.policies.split(","):
            _flush(urls)
            router = SglangRouter(port, urls, policy=policy, log_path=os.path.join(args.log_dir, "router.log"),
                                  ready_timeout=120)
            with router as url:
                print(f"router {policy}: {len(prompts)} requests, {args.clients} clients ...", flush=True)
                runs[f"router {policy}"] = asyncio.run(run_requests(url, prompts, args))
            print(json.dumps(runs[f"router {policy}"]), flush=True)
    finally:
        for w in workers:
            w.stop()
    return runs


def measure_dp(prompts, args, port: int) -> dict:
    """One --dp-size 2 server (the in-process balancer), no router."""
    server = LmprogServer(port, model_path=args.model_path,
                          extra_args=server_args(args, 2) + ["--dp-size", "2", "--load-balance-method",
                                                             "round_robin"],
                          log_path=os.path.join(args.log_dir, "router-dp2.log"))
    with server as url:
        _warm(url)
        _warm(url)  # one warm-up per replica (round_robin)
        _flush([url])
        print(f"--dp-size 2 round_robin: {len(prompts)} requests ...", flush=True)
        run = asyncio.run(run_requests(url, prompts, args))
    print(json.dumps(run), flush=True)
    return {"dp-size 2 round_robin": run}


def plot(results, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results["runs"]
    names = list(runs)
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    panels = [("request_throughput", "requests/s", 1), ("hit_rate", "prefix hit rate (%)", 100),
              ("mean_ttft_s", "mean TTFT (ms)", 1000)]
    for ax, (key, label, scale) in zip(axes, panels):
        values = [runs[n][key] * scale for n in names]
        ax.bar(range(len(names)), values, color=["tab:green", "tab:gray", "tab:blue"][:len(names)])
        ax.set_xticks(range(len(names)), names, rotation=15, fontsize=8)
        ax.set_ylabel(label)
        for i, v in enumerate(values):
            ax.text(i, v, f"{v:.2f}" if scale == 1 else f"{v:.0f}", ha="center", va="bottom", fontsize=8)
    c = results["config"]
    fig.suptitle(f"{c['docs']} documents x {c['questions']} questions (~{c['doc_tokens']} tokens), "
                 f"{c['clients']} clients, two replicas")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", default="default")
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--doc-tokens", type=int, default=1500)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--max-total-tokens", type=int, default=None,
                    help="KV pool of each replica (default: room for about half the documents, so that "
                         "where a document's questions go decides whether its KV is still cached)")
    ap.add_argument("--policies", default="cache_aware,round_robin")
    ap.add_argument("--no-dp", action="store_true", help="skip the --dp-size 2 comparison")
    ap.add_argument("--port", type=int, default=31400)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="2 documents x 3 questions, ~300 tokens, 4 clients")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.docs, args.questions, args.doc_tokens, args.output_len, args.clients = 2, 3, 300, 4, 4
    if args.max_total_tokens is None:  # ~4.5 of 8 documents: a replica cannot keep them all
        args.max_total_tokens = int((args.docs / 2 + 0.5) * (args.doc_tokens + 64))
    args.out = args.out or os.path.join(HERE, "results", "router_quick.json" if args.quick else "router.json")
    args.log_dir = os.path.join(HERE, "results", "logs")
    os.makedirs(args.log_dir, exist_ok=True)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    prompts = build_prompts(args)
    results = {"config": {k: v for k, v in vars(args).items() if k != "log_dir"}, "runs": {}}
    results["runs"].update(measure_router(prompts, args, args.port))
    if not args.no_dp:
        results["runs"].update(measure_dp(prompts, args, args.port + 10))
    runs = results["runs"]
    if "router cache_aware" in runs and "router round_robin" in runs:
        aware, rr = runs["router cache_aware"], runs["router round_robin"]
        results["cache_aware_vs_round_robin"] = {
            "throughput": aware["request_throughput"] / rr["request_throughput"],
            "hit_rate": [aware["hit_rate"], rr["hit_rate"]]}
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    plot(results, args.out.replace(".json", ".png"))
    for name, r in runs.items():
        print(f"{name:24s} {r['request_throughput']:.2f} req/s, hit {r['hit_rate']:.0%}, "
              f"mean TTFT {r['mean_ttft_s'] * 1000:.0f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
