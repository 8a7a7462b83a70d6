"""Real prefill and decode servers (`python -m lmprog_runtime serve`) and the router's part
in a few lines: POST the same body, with bootstrap fields, to both; answer with the decode
response, the prefill response's input logprobs prepended (SGLang's mini_lb, §7.2 step 5)."""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor
from typing import List

import requests

from server_harness import LiveServer, free_port

FAST_FAILURES = {"SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "0.3"}


def start_pair(model_path, log_dir, backend: str = "mooncake", env=None, extra=()):
    """(prefill LiveServer, decode LiveServer, bootstrap port)."""
    port = free_port()
    common = ["--disaggregation-transfer-backend", backend, *extra]
    env = {**FAST_FAILURES, **(env or {})}
    with ThreadPoolExecutor(2) as pool:  # both start at once: each imports torch
        p = pool.submit(lambda: LiveServer(model_path, log_dir, extra_args=[
            "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(port), *common],
            env=env).start())
        d = pool.submit(lambda: LiveServer(model_path, log_dir, extra_args=[
            "--disaggregation-mode", "decode", *common], env=env).start())
        return p.result(), d.result(), port


def with_bootstrap(body: dict, port: int) -> dict:
    return {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": port,
            "bootstrap_room": random.randrange(1 << 63)}


def sse_events(resp) -> List:
    out = []
    for line in resp.iter_lines(decode_unicode=True):
        if line and line.startswith("data: "):
            payload = line[len("data: "):]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def _merge_chunk(prefill_meta: dict, chunk: dict) -> dict:
    if isinstance(chunk, dict) and "meta_info" in chunk and "input_token_logprobs" in prefill_meta:
        chunk = {**chunk, "meta_info": {**chunk["meta_info"], "input_token_logprobs":
                                        prefill_meta["input_token_logprobs"]
                                        + (chunk["meta_info"].get("input_token_logprobs") or [])}}
    return chunk


def proxy_generate(prefill_url: str, decode_url: str, port: int, body: dict):
    """(status, merged body or list of merged SSE events) of one /generate through the pair."""
    body = with_bootstrap(body, port)
    with ThreadPoolExecutor(2) as pool:
        pf = pool.submit(requests.post, prefill_url + "/generate", json=body, timeout=120)
        stream = bool(body.get("stream"))
        df = pool.submit(requests.post, decode_url + "/generate", json=body, timeout=120, stream=stream)
        p, d = pf.result(), df.result()
    if stream:
        events = sse_events(d)
        prefill_meta = sse_events(p)[-2]["meta_info"] if p.status_code == 200 else {}
        return d.status_code, [_merge_chunk(prefill_meta, e) for e in events]
    if d.status_code != 200 or p.status_code != 200:
        return max(d.status_code, p.status_code), {"prefill": p.text, "decode": d.text}
    return 200, _merge_chunk(p.json()["meta_info"], d.json())
