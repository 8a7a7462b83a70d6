"""Serving benchmark (after SGLang's bench_serving): drive a running server over HTTP.

    python bench/bench_serving.py --backend lmprog --port 30000 --dataset-name shared-prefix
    python bench/bench_serving.py --backend oai --base-url http://127.0.0.1:8001 --dataset-name random \
        --num-prompts 32 --max-concurrency 8

Backends: `lmprog` = native `POST /generate` (SSE, cumulative `text`, `meta_info` token
counts — also SGLang itself), `oai` = `POST /v1/completions` (any OpenAI-compatible
server, e.g. llama.cpp's). Datasets are synthetic (`bench/workloads.py`): `random`,
`shared-prefix` (SGLang's generated-shared-prefix) and `document-assistant` (one long
handbook, many questions). Load: all at once (`--request-rate inf`), Poisson arrivals,
or a fixed `--max-concurrency`. Reports request and token throughput, TTFT, TPOT, ITL and
end-to-end latency (mean, median, p90, p99) and the prefix-cache hit rate, and writes
JSON (with per-request records, for the plots) to `--output-file`.
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
from dataclasses import asdict, dataclass, field
from typing import List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.workloads import (Request, document_assistant_requests, random_requests,  # noqa: E402
                             shared_prefix_requests)

DATASETS = ("random", "shared-prefix", "document-assistant")
WARMUP_PROMPT = "Warm-up request: say hello."  # shares no prefix with any dataset


# --- datasets ------------------------------------------------------------------------------------

def add_dataset_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--dataset-name", choices=DATASETS, default="shared-prefix")
    ap.add_argument("--num-prompts", type=int, default=64, help="random / document-assistant size")
    ap.add_argument("--random-input-len", type=int, default=256)
    ap.add_argument("--random-output-len", type=int, default=32)
    ap.add_argument("--random-range-ratio", type=float, default=0.5)
    ap.add_argument("--gsp-num-groups", type=int, default=4)
    ap.add_argument("--gsp-prompts-per-group", type=int, default=16)
    ap.add_argument("--gsp-system-prompt-len", type=int, default=768)
    ap.add_argument("--gsp-question-len", type=int, default=48)
    ap.add_argument("--gsp-output-len", type=int, default=32)
    ap.add_argument("--gsp-ordered", action="store_true", help="do not shuffle the groups' prompts")
    ap.add_argument("--doc-tokens", type=int, default=1500)
    ap.add_argument("--doc-output-len", type=int, default=32)
    ap.add_argument("--seed", type=int, default=42)


def build_requests(args) -> List[Request]:
    rng = random.Random(args.seed)
    if args.dataset_name == "random":
        return random_requests(args.num_prompts, args.random_input_len, args.random_output_len,
                               args.random_range_ratio, rng)
    if args.dataset_name == "shared-prefix":
        return shared_prefix_requests(args.gsp_num_groups, args.gsp_prompts_per_group, args.gsp_system_prompt_len,
                                      args.gsp_question_len, args.gsp_output_len, rng, args.gsp_ordered)
    return document_assistant_requests(args.num_prompts, args.doc_tokens, args.doc_output_len, rng)


# --- one request ----------------------------------------------------------------------------------

@dataclass
class RequestRecord:
    """What the client saw of one request. Times in seconds; `start` relative to the run."""

    ok: bool = False
    error: str = ""
    start: float = 0.0
    ttft: float = 0.0
    latency: float = 0.0
    itl: List[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: Optional[int] = None  # None: the server does not report it


async def _sse_events(resp):
    """Decoded JSON objects of an SSE body (`data: ...` lines, `[DONE]` dropped)."""
    async for raw in resp.content:
        line = raw.decode("utf-8").strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


def _sampling(req: Request, extra: dict) -> dict:
    return {"temperature": 0.0, "max_new_tokens": req.output_len, "ignore_eos": True, **extra}


async def send_native(session, base_url: str, req: Request, args, rec: RequestRecord) -> None:
    payload = {"text": req.prompt, "sampling_params": _sampling(req, {}), "stream": not args.disable_stream,
               **args.extra_request_body}
    t0 = time.perf_counter()
    last_t, last_count, meta = t0, 0, {}
    async with session.post(base_url + "/generate", json=payload) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
        if args.disable_stream:
            body = await resp.json()
            meta = body["meta_info"]
        else:
            async for chunk in _sse_events(resp):
                if "error" in chunk:
                    raise RuntimeError(str(chunk["error"]))
                meta = chunk["meta_info"]
                count, now = meta["completion_tokens"], time.perf_counter()
                if chunk.get("text") and rec.ttft == 0.0:
                    rec.ttft = now - t0
                elif count > last_count and rec.ttft:
                    rec.itl.extend([(now - last_t) / (count - last_count)] * (count - last_count))
                if count > last_count:
                    last_t, last_count = now, count
    rec.latency = time.perf_counter() - t0
    rec.ttft = rec.ttft or rec.latency
    rec.prompt_tokens = meta.get("prompt_tokens", req.prompt_len)
    rec.output_tokens = meta.get("completion_tokens", 0)
    rec.cached_tokens = meta.get("cached_tokens")


async def send_oai(session, base_url: str, req: Request, args, rec: RequestRecord) -> None:
    payload = {"model": args.model, "prompt": req.prompt, "max_tokens": req.output_len, "temperature": 0.0,
               "ignore_eos": True, "stream": not args.disable_stream, **args.extra_request_body}
    if not args.disable_stream:
        payload["stream_options"] = {"include_usage": True}
    t0 = time.perf_counter()
    last_t, chunks, usage, finish = t0, 0, None, None
    async with session.post(base_url + "/v1/completions", json=payload) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
        if args.disable_stream:
            body = await resp.json()
            usage = body.get("usage")
        else:
            async for chunk in _sse_events(resp):
                usage = chunk.get("usage") or usage
                if chunk.get("choices") and chunk["choices"][0].get("finish_reason"):
                    finish = chunk["choices"][0]["finish_reason"]
                if not chunk.get("choices") or not chunk["choices"][0].get("text"):
                    continue
                now = time.perf_counter()
                if chunks == 0:
                    rec.ttft = now - t0
                else:
                    rec.itl.append(now - last_t)
                last_t, chunks = now, chunks + 1
    rec.latency = time.perf_counter() - t0
    rec.ttft = rec.ttft or rec.latency
    rec.prompt_tokens = (usage or {}).get("prompt_tokens") or req.prompt_len
    # without usage (llama.cpp streams none): a "length" finish means all of them, else one per text chunk
    rec.output_tokens = (usage or {}).get("completion_tokens") or (req.output_len if finish == "length" else chunks)
    details = (usage or {}).get("prompt_tokens_details") or {}
    rec.cached_tokens = details.get("cached_tokens")


SENDERS = {"lmprog": send_native, "oai": send_oai}


# --- the run -------------------------------------------------------------------------------------

async def _server_state(session, base_url: str) -> Optional[dict]:
    """The scheduler's counters (`/get_server_info`), or None where the server has none."""
    try:
        async with session.get(base_url + "/get_server_info") as resp:
            if resp.status != 200:
                return None
            states = (await resp.json()).get("internal_states") or [None]
            return states[0]
    except Exception:  # noqa: BLE001 — another server, another API
        return None


def server_delta(before: Optional[dict], after: Optional[dict]) -> Optional[dict]:
    """Counter increments over the run, and what follows from them (hit rate, batch size, overhead)."""
    if not before or not after:
        return None
    keys = ("num_prompt_tokens", "num_cached_tokens", "num_generated_tokens", "num_steps", "forward_s", "step_s",
            "num_retractions")
    d = {k: after[k] - before[k] for k in keys if k in after and k in before}
    if d.get("num_prompt_tokens"):
        d["cache_hit_rate"] = d.get("num_cached_tokens", 0) / d["num_prompt_tokens"]
    if d.get("step_s"):
        d["scheduler_share"] = 1 - d.get("forward_s", 0.0) / d["step_s"]
    if d.get("num_steps"):
        d["tokens_per_step"] = d.get("num_generated_tokens", 0) / d["num_steps"]
    return d


async def _wait_ready(session, base_url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            async with session.get(base_url + "/v1/models") as resp:
                if resp.status == 200:
                    return
        except Exception:  # noqa: BLE001 — not up yet
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{base_url} did not answer GET /v1/models within {timeout:.0f}s")
        await asyncio.sleep(1.0)


async def run_async(args, requests: List[Request]) -> dict:
    import aiohttp
    from tqdm.auto import tqdm

    send = SENDERS[args.backend]
    timeout = aiohttp.ClientTimeout(total=None, sock_read=args.request_timeout)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        await _wait_ready(session, args.base_url, args.ready_timeout)
        for _ in range(args.warmup_requests):
            await send(session, args.base_url, Request(WARMUP_PROMPT, 8, 4), args, RequestRecord())
        if args.flush_cache:
            async with session.post(args.base_url + "/flush_cache") as resp:
                await resp.read()
        before = await _server_state(session, args.base_url)
        records = [RequestRecord() for _ in requests]
        limit = asyncio.Semaphore(args.max_concurrency or len(requests) or 1)
        bar = tqdm(total=len(requests), desc=f"{args.system or args.backend} {args.dataset_name}",
                   disable=args.no_progress)
        rng = random.Random(args.seed)
        t_run = time.perf_counter()

        async def one(req: Request, rec: RequestRecord):
            async with limit:
                rec.start = time.perf_counter() - t_run
                try:
                    await send(session, args.base_url, req, args, rec)
                    rec.ok = True
                except Exception as e:  # noqa: BLE001 — recorded, reported, counted as failed
                    rec.error = f"{type(e).__name__}: {e}"
            bar.update(1)

        tasks = []
        for req, rec in zip(requests, records):
            tasks.append(asyncio.create_task(one(req, rec)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - t_run
        bar.close()
        after = await _server_state(session, args.base_url)
    return {"duration_s": duration, "records": records, "server": server_delta(before, after)}


# --- metrics -------------------------------------------------------------------------------------

def percentiles(values: List[float], scale: float = 1000.0) -> dict:
    """mean / median / p90 / p99 (milliseconds by default); empty lists give None."""
    if not values:
        return {"mean": None, "median": None, "p90": None, "p99": None}
    ordered = sorted(values)

    def pct(p):
        k = (len(ordered) - 1) * p / 100
        lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
        return (ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)) * scale
    return {"mean": statistics.fmean(ordered) * scale, "median": pct(50), "p90": pct(90), "p99": pct(99)}


def compute_metrics(records: List[RequestRecord], duration: float, server: Optional[dict] = None) -> dict:
    done = [r for r in records if r.ok]
    total_in = sum(r.prompt_tokens for r in done)
    total_out = sum(r.output_tokens for r in done)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    reported = [r for r in done if r.cached_tokens is not None]
    hit = None
    if server and "cache_hit_rate" in server:
        hit = server["cache_hit_rate"]
    elif reported and sum(r.prompt_tokens for r in reported):
        hit = sum(r.cached_tokens for r in reported) / sum(r.prompt_tokens for r in reported)
    return {
        "completed": len(done), "failed": len(records) - len(done), "duration_s": duration,
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(done) / duration, "input_throughput": total_in / duration,
        "output_throughput": total_out / duration, "total_throughput": (total_in + total_out) / duration,
        "concurrency": sum(r.latency for r in done) / duration,
        "ttft_ms": percentiles([r.ttft for r in done]), "tpot_ms": percentiles(tpots),
        "itl_ms": percentiles([x for r in done for x in r.itl]), "e2e_ms": percentiles([r.latency for r in done]),
        "cache_hit_rate": hit,
    }


def print_metrics(title: str, m: dict) -> None:
    print(f"\n{'=' * 16} {title} {'=' * 16}")
    rows = [("Successful requests", m["completed"]), ("Failed requests", m["failed"]),
            ("Benchmark duration (s)", m["duration_s"]), ("Total input tokens", m["total_input_tokens"]),
            ("Total generated tokens", m["total_output_tokens"]),
            ("Request throughput (req/s)", m["request_throughput"]),
            ("Input token throughput (tok/s)", m["input_throughput"]),
            ("Output token throughput (tok/s)", m["output_throughput"]), ("Concurrency", m["concurrency"]),
            ("Cache hit rate", m["cache_hit_rate"])]
    for name in ("ttft", "tpot", "itl", "e2e"):
        for stat in ("mean", "median", "p90", "p99"):
            rows.append((f"{stat.capitalize()} {name.upper()} (ms)", m[f"{name}_ms"][stat]))
    for label, value in rows:
        shown = "n/a" if value is None else (f"{value:.2f}" if isinstance(value, float) else value)
        print(f"{label:<34}{shown:>12}")


def write_result(path: str, system: str, workload: str, args_dict: dict, metrics: dict,
                 records: List[RequestRecord], server: Optional[dict]) -> None:
    """One JSON per (workload, system): what run_all and plots read."""
    result = {"kind": "serving", "system": system, "workload": workload,
              "command": "python " + " ".join(sys.argv), "config": args_dict, "metrics": metrics,
              "server": server, "requests": [asdict(r) for r in records], "errors": sorted(
                  {r.error for r in records if r.error})[:5]}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=sorted(SENDERS), default="lmprog")
    ap.add_argument("--base-url", default=None)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--model", default="default", help="model name sent to /v1/completions")
    add_dataset_args(ap)
    ap.add_argument("--request-rate", type=float, default=float("inf"), help="req/s, Poisson; inf = all at once")
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--warmup-requests", type=int, default=1)
    ap.add_argument("--flush-cache", action="store_true", help="POST /flush_cache after the warm-up")
    ap.add_argument("--disable-stream", action="store_true")
    ap.add_argument("--extra-request-body", type=json.loads, default={},
                    help='JSON merged into every request, e.g. \'{"logit_bias": {"2": -100}}\'')
    ap.add_argument("--request-timeout", type=float, default=1800.0)
    ap.add_argument("--ready-timeout", type=float, default=60.0)
    ap.add_argument("--system", default=None, help="name of the system under test, for the report")
    ap.add_argument("--output-file", default=None)
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    args.base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    requests = build_requests(args)
    out = asyncio.run(run_async(args, requests))
    metrics = compute_metrics(out["records"], out["duration_s"], out["server"])
    system = args.system or args.backend
    print_metrics(f"{system} / {args.dataset_name}", metrics)
    if out["server"]:
        print("server:", json.dumps({k: round(v, 4) for k, v in out["server"].items()}))
    errors = sorted({r.error for r in out["records"] if r.error})
    if errors:
        print("errors (first 3):", *errors[:3], sep="\n  ")
    if args.output_file:
        config = {k: v for k, v in vars(args).items() if k != "request_rate"}
        config["request_rate"] = str(args.request_rate)
        write_result(args.output_file, system, args.dataset_name, config, metrics, out["records"], out["server"])
        print(f"wrote {args.output_file}")
    return 0 if metrics["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
