"""Bounded mixed soak of a server: streams, aborts, constrained, long prompts, bad requests.

    python bench/soak.py --model-path default --minutes 30 --concurrency 16 --output-file soak.json
    python bench/soak.py --base-url http://127.0.0.1:30000 --server-pid 1234 --minutes 5

With --model-path it launches `python -m lmprog_runtime serve` on a free port itself (and
knows both pids); with --base-url it drives a running server. Every minute (or every
--sample-s seconds) it samples the RSS of the server and scheduler processes and the p99
latency of the normal (non-streaming, unconstrained) requests of that interval. At the end
it waits for the server to go idle and reads the KV audit. The JSON report holds the
per-interval samples, counts per request kind, unexpected answers and the audit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from typing import Dict, List, Optional

import aiohttp

BAD_BODIES = [
    {"text": "hi", "sampling_params": {"sampling_seed": 1 << 64}},
    {"text": "hi", "sampling_params": {"logit_bias": {"5": "x"}}},
    {"text": "hi", "cache_salt": ["a"]}, {"input_ids": [-1]}, {"text": "hi", "stream": "false"},
    {"text": "hi", "sampling_params": {"n": 10 ** 6}}, {"text": "hi", "sampling_params": {"regex": "(("}},
    {"text": "\ud800"}, {"text": "hi", "rid": "HEALTH_CHECK_soak"},
    {"text": "hi", "sampling_params": {"max_new_tokens": 10 ** 6}},
]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer"}}, "required": ["name", "age"]}
KINDS = {"normal": 6, "stream": 3, "abort": 2, "constrained": 2, "long": 1, "bad": 2}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: Optional[int]) -> Optional[float]:
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def p99(values: List[float]) -> Optional[float]:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


class Soak:
    def __init__(self, url: str, pids: Dict[str, Optional[int]], max_new_tokens: int, long_words: int):
        self.url, self.pids = url, pids
        self.max_new_tokens, self.long_words = max_new_tokens, long_words
        self.counts: Counter = Counter()
        self.unexpected: List[str] = []
        self.latencies: List[float] = []  # normal requests of the current interval, seconds
        self.samples: List[dict] = []

    async def one(self, session: aiohttp.ClientSession, kind: str) -> None:
        sp = {"max_new_tokens": random.randint(1, self.max_new_tokens), "temperature": random.choice([0, 0.8])}
        prompt = f"Soak request {random.randint(0, 10 ** 6)}: tell me a story."
        body: dict = {"text": prompt, "sampling_params": sp}
        if kind == "constrained":
            sp.update(random.choice([{"regex": "[a-z]{2,6}( [a-z]{2,6}){0,3}"}, {"json_schema": json.dumps(SCHEMA)}]))
        elif kind == "long":
            body["text"] = " ".join(random.choice(["alpha", "beta", "gamma", "delta"]) for _ in range(self.long_words))
        elif kind == "bad":
            body = random.choice(BAD_BODIES)
        if kind in ("stream", "abort"):
            return await self._stream(session, body, abort=kind == "abort")
        t0 = time.monotonic()
        async with session.post(self.url + "/generate", data=json.dumps(body, ensure_ascii=True),
                                headers={"Content-Type": "application/json"}) as r:
            await r.read()
            ok = (400 <= r.status < 500) if kind == "bad" else r.status == 200
        if kind == "normal" and ok:
            self.latencies.append(time.monotonic() - t0)
        self._count(kind, ok, r.status)

    async def _stream(self, session, body: dict, abort: bool) -> None:
        body = {**body, "stream": True}
        if abort:
            body["sampling_params"] = {**body["sampling_params"], "max_new_tokens": 200, "ignore_eos": True}
        events, done = 0, False
        async with session.post(self.url + "/generate", json=body) as r:
            async for line in r.content:
                if line.startswith(b"data: "):
                    events += 1
                    done = line.strip() == b"data: [DONE]"
                    if abort and events >= 2:
                        break  # the client goes away mid-stream
        self._count("abort" if abort else "stream", r.status == 200 and (abort or done), r.status)

    def _count(self, kind: str, ok: bool, status: int) -> None:
        self.counts[kind] += 1
        if not ok:
            self.counts[f"{kind}_unexpected"] += 1
            if len(self.unexpected) < 50:
                self.unexpected.append(f"{kind}: HTTP {status}")

    def sample(self, t: float) -> None:
        self.samples.append({"t_s": round(t, 1), "server_rss_mib": rss_mib(self.pids.get("server")),
                             "scheduler_rss_mib": rss_mib(self.pids.get("scheduler")),
                             "normal_p99_s": p99(self.latencies), "normal_requests": len(self.latencies)})
        self.latencies = []
        print(json.dumps(self.samples[-1]), flush=True)


async def worker(soak: Soak, session, deadline: float) -> None:
    kinds, weights = zip(*KINDS.items())
    while time.monotonic() < deadline:
        kind = random.choices(kinds, weights)[0]
        try:
            await soak.one(session, kind)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            soak._count(kind, False, 0)
            soak.unexpected.append(f"{kind}: {type(e).__name__}: {e}"[:200])


async def run(args, url: str, pids: Dict[str, Optional[int]]) -> dict:
    timeout = aiohttp.ClientTimeout(total=args.request_timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.get(url + "/get_server_info") as r:
            pids.setdefault("scheduler", (await r.json()).get("scheduler_pid"))
        soak = Soak(url, pids, args.max_new_tokens, args.long_words)
        t0 = time.monotonic()
        deadline = t0 + args.minutes * 60
        soak.sample(0.0)
        tasks = [asyncio.create_task(worker(soak, session, deadline)) for _ in range(args.concurrency)]
        while time.monotonic() < deadline:
            await asyncio.sleep(min(args.sample_s, max(0.0, deadline - time.monotonic())))
            soak.sample(time.monotonic() - t0)
        await asyncio.gather(*tasks)
        audit = await _audit(session, url)
    return {"minutes": args.minutes, "concurrency": args.concurrency, "counts": dict(soak.counts),
            "unexpected": soak.unexpected, "samples": soak.samples, "audit": audit}


async def _audit(session, url: str, timeout_s: float = 60) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        async with session.get(url + "/get_server_info") as r:
            state = (await r.json())["internal_states"][0]
        idle = state["num_running_reqs"] == 0 and state["num_queue_reqs"] == 0 and state["integrity"] != "busy"
        if idle or time.monotonic() > deadline:
            return {"idle": idle, "integrity": state["integrity"], "num_used_tokens": state["num_used_tokens"]}
        await asyncio.sleep(0.2)


def launch(model_path: str, extra: List[str]) -> tuple:
    port = _free_port()
    argv = [sys.executable, "-m", "lmprog_runtime", "serve", "--model-path", model_path, "--host", "127.0.0.1",
            "--port", str(port), "--log-level", "warning", *extra]
    proc = subprocess.Popen(argv, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    url = f"http://127.0.0.1:{port}"
    import urllib.request
    for _ in range(1200):
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            if urllib.request.urlopen(url + "/health", timeout=5).status == 200:
                return proc, url
        except OSError:
            time.sleep(0.5)
    raise SystemExit("the server did not become healthy")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url")
    p.add_argument("--server-pid", type=int)
    p.add_argument("--model-path", help="launch a server on this model instead of --base-url")
    p.add_argument("--server-args", default="", help="extra flags for the launched server")
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--sample-s", type=float, default=60.0, help="RSS / p99 sampling interval")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--long-words", type=int, default=700, help="words in a long prompt")
    p.add_argument("--request-timeout-s", type=float, default=120.0)
    p.add_argument("--output-file")
    args = p.parse_args(argv)
    if not (args.base_url or args.model_path):
        p.error("give --base-url or --model-path")
    proc = None
    url, pids = args.base_url, {"server": args.server_pid}
    if args.model_path:
        proc, url = launch(args.model_path, args.server_args.split())
        pids["server"] = proc.pid
    try:
        report = asyncio.run(run(args, url.rstrip("/"), pids))
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    text = json.dumps(report, indent=1)
    if args.output_file:
        with open(args.output_file, "w") as f:
            f.write(text)
    print(json.dumps({k: report[k] for k in ("counts", "audit")}))
    bad = report["audit"]["integrity"] != "ok" or report["audit"]["num_used_tokens"] != 0
    return 1 if bad or any(k.endswith("_unexpected") for k in report["counts"]) else 0


if __name__ == "__main__":
    sys.exit(main())
