"""Prefill/decode disaggregation vs one colocated server, on a mixed workload.

    python bench/bench_disagg.py            # SmolLM2, 3,000-token long prompts, 48 short requests
    python bench/bench_disagg.py --quick    # fewer, shorter requests: a few minutes

A stream of short chat requests (`--short-requests`, ~`--short-tokens` prompt tokens,
`--short-output` greedy tokens, Poisson arrivals at `--rate`/s) while long prompts
(`--long-requests` of `--long-tokens` tokens, 8 output tokens) arrive evenly over the same
time. Two setups on the same cores:

    colocated   one server, --num-threads 2
    pd          a prefill server and a decode server, --num-threads 1 each, KV over Mooncake
                TCP; the router's part (the same body with bootstrap fields to both,
                answered from the decode server) is done here

Reported for the short requests: TTFT and inter-token latency, median and p99, both ways;
for pd also the bytes moved and the transfer time per request (the decode server's
counters). Writes bench/results/disagg.json and disagg.png. Timings mean something only on
a quiet machine (two cores shared with nothing else).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import sys
import time
from typing import List

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.baselines.servers import LmprogServer  # noqa: E402
from bench.bench_serving import percentiles  # noqa: E402
from bench.workloads import handbook, words  # noqa: E402

RESULTS = os.path.join(HERE, "results")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server(args, threads: int, extra: List[str], log_dir: str, name: str) -> LmprogServer:
    """A started (not yet ready) lmprog server; its log is disagg-<name>.log in log_dir."""
    argv = ["--num-threads", str(threads), "--max-total-tokens", str(args.max_total_tokens), *extra]
    return LmprogServer(free_port(), model_path=args.model_path, extra_args=argv,
                        log_path=os.path.join(log_dir, f"disagg-{name}.log"), ready_timeout=600).start()


def decode_state(server: LmprogServer) -> dict:
    import requests
    return requests.get(server.url + "/get_server_info", timeout=30).json()["internal_states"][0]


# -- workload ------------------------------------------------------------------------------------
def workload(args) -> List[dict]:
    """Requests with their arrival offsets (seconds): {"at", "kind", "prompt", "output"}."""
    rng = random.Random(args.seed)
    reqs, t = [], 0.0
    for i in range(args.short_requests):
        t += rng.expovariate(args.rate)
        reqs.append({"at": t, "kind": "short", "output": args.short_output,
                     "prompt": f"Chat {i}: " + words(args.short_tokens, rng) + "\nReply briefly:"})
    span = t
    for j in range(args.long_requests):
        at = span * (j + 0.5) / args.long_requests
        reqs.append({"at": at, "kind": "long", "output": 8,
                     "prompt": handbook(args.long_tokens, seed=100 + j) + "\nSummarize section 3."})
    return sorted(reqs, key=lambda r: r["at"])


async def _stream(session, url: str, body: dict, rec: dict) -> None:
    t0 = time.perf_counter()
    last, count = t0, 0
    async with session.post(url + "/generate", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line.endswith("[DONE]"):
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk:
                raise RuntimeError(str(chunk["error"]))
            now, n = time.perf_counter(), chunk["meta_info"]["completion_tokens"]
            if n and not count:
                rec["ttft"] = now - t0
            elif n > count:
                rec["itl"].extend([(now - last) / (n - count)] * (n - count))
            if n > count:
                last, count = now, n
    rec["latency"] = time.perf_counter() - t0


async def _one(session, setup: dict, req: dict, t_start: float, rec: dict) -> None:
    await asyncio.sleep(max(0.0, t_start + req["at"] - time.perf_counter()))
    body = {"text": req["prompt"], "stream": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": req["output"], "ignore_eos": True}}
    if setup["prefill"] is None:
        return await _stream(session, setup["decode"], body, rec)
    body.update(bootstrap_host="127.0.0.1", bootstrap_port=setup["bootstrap_port"],
                bootstrap_room=random.randrange(1 << 63))
    prefill = asyncio.ensure_future(session.post(setup["prefill"] + "/generate", json={**body, "stream": False}))
    try:
        await _stream(session, setup["decode"], body, rec)
    finally:
        resp = await prefill
        await resp.read()
        resp.release()


async def drive(setup: dict, reqs: List[dict]) -> List[dict]:
    import aiohttp
    records = [{"kind": r["kind"], "ttft": None, "itl": [], "latency": None} for r in reqs]
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*[_one(session, setup, r, t0, rec) for r, rec in zip(reqs, records)])
    return records


def summarize(records: List[dict]) -> dict:
    short = [r for r in records if r["kind"] == "short"]
    ttft = percentiles([r["ttft"] for r in short if r["ttft"] is not None])
    itl = percentiles([x for r in short for x in r["itl"]])
    pick = lambda m: {"median_ms": m["median"], "p99_ms": m["p99"]}  # noqa: E731
    return {"short_ttft": pick(ttft), "short_itl": pick(itl), "num_short": len(short),
            "num_long": len(records) - len(short)}


# -- setups --------------------------------------------------------------------------------------
def run_colocated(args, reqs, log_dir) -> dict:
    colocated = server(args, 2, [], log_dir, "colocated")
    try:
        colocated.wait_ready()
        setup = {"prefill": None, "decode": colocated.url}
        asyncio.run(drive(setup, reqs[:2]))  # warm-up
        return summarize(asyncio.run(drive(setup, reqs)))
    finally:
        colocated.stop()


def run_pd(args, reqs, log_dir) -> dict:
    port = free_port()
    backend = ["--disaggregation-transfer-backend", args.transfer_backend]
    prefill = server(args, 1, ["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(port),
                               *backend], log_dir, "prefill")
    decode = server(args, 1, ["--disaggregation-mode", "decode", *backend], log_dir, "decode")
    try:
        prefill.wait_ready(), decode.wait_ready()
        setup = {"prefill": prefill.url, "decode": decode.url, "bootstrap_port": port}
        asyncio.run(drive(setup, reqs[:2]))  # warm-up
        before = decode_state(decode)
        out = summarize(asyncio.run(drive(setup, reqs)))
        after = decode_state(decode)
        n = after["num_disagg_transfers"] - before["num_disagg_transfers"]
        moved = after["disagg_bytes_received"] - before["disagg_bytes_received"]
        seconds = after["disagg_transfer_s"] - before["disagg_transfer_s"]
        out.update(transfers=n, bytes_per_request=moved / n if n else None,
                   transfer_ms_per_request=1000 * seconds / n if n else None,
                   transfer_failures=after["num_disagg_failures"] - before["num_disagg_failures"])
        return out
    finally:
        prefill.stop()
        decode.stop()


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for ax, metric, title in ((axes[0], "short_ttft", "TTFT of short requests"),
                              (axes[1], "short_itl", "inter-token latency of short requests")):
        names = list(result["setups"])
        for k, stat in enumerate(("median_ms", "p99_ms")):
            vals = [result["setups"][n][metric][stat] or 0 for n in names]
            ax.bar([i + 0.38 * k for i in range(len(names))], vals, width=0.38, label=stat.replace("_ms", ""))
        ax.set_xticks([i + 0.19 for i in range(len(names))], [n.replace(" (", "\n(") for n in names], fontsize=8)
        ax.set_ylabel("ms")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    fig.suptitle(f"{result['workload']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", default="default")
    ap.add_argument("--quick", action="store_true", help="a few minutes: fewer and shorter requests")
    ap.add_argument("--short-requests", type=int, default=48)
    ap.add_argument("--short-tokens", type=int, default=64)
    ap.add_argument("--short-output", type=int, default=32)
    ap.add_argument("--long-requests", type=int, default=6)
    ap.add_argument("--long-tokens", type=int, default=3000)
    ap.add_argument("--rate", type=float, default=1.0, help="short requests per second")
    ap.add_argument("--max-total-tokens", type=int, default=16384)
    ap.add_argument("--transfer-backend", default="mooncake", choices=["mooncake", "fake"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(RESULTS, "disagg.json"))
    args = ap.parse_args(argv)
    if args.quick:
        args.short_requests, args.long_requests, args.long_tokens, args.short_output = 12, 2, 1000, 16
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    import tempfile
    log_dir = tempfile.mkdtemp(prefix="bench_disagg_")  # the three servers' logs
    print(f"server logs in {log_dir}", flush=True)
    reqs = workload(args)
    result = {"workload": f"{args.short_requests} short (~{args.short_tokens} tok in, {args.short_output} out, "
                          f"{args.rate}/s) + {args.long_requests} long ({args.long_tokens} tok)",
              "quick": args.quick, "model_path": args.model_path, "transfer_backend": args.transfer_backend,
              "setups": {}}
    result["setups"]["colocated (2 threads)"] = run_colocated(args, reqs, log_dir)
    result["setups"]["prefill + decode (1 thread each)"] = run_pd(args, reqs, log_dir)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    plot(result, os.path.splitext(args.out)[0] + ".png")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
