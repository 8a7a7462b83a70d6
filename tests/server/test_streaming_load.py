"""Streaming under load and client disconnects: every KV slot comes back."""

import asyncio
import json
import time

import aiohttp
import requests

from server_harness import internal_state, wait_idle

NUM_STREAMS = 64
PARAMS = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}


async def _stream(session, url, prompt):
    """All SSE chunks of one streaming /generate, in order."""
    chunks = []
    async with session.post(url + "/generate", json={"text": prompt, "stream": True,
                                                     "sampling_params": PARAMS}) as resp:
        assert resp.status == 200
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            payload = line[len("data: "):]
            if payload == "[DONE]":
                return chunks
            chunks.append(json.loads(payload))
    raise AssertionError("stream ended without [DONE]")


async def _many_streams(url, prompts):
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        return await asyncio.gather(*(_stream(session, url, p) for p in prompts))


def test_64_concurrent_streams(live_server):
    prompts = [f"Request number {i} says" for i in range(NUM_STREAMS)]
    expected = requests.post(live_server + "/generate", json={"text": prompts, "sampling_params": PARAMS},
                             timeout=300).json()
    results = asyncio.run(_many_streams(live_server, prompts))
    assert len(results) == NUM_STREAMS
    for prompt, chunks, want in zip(prompts, results, expected):
        final = chunks[-1]
        assert final["meta_info"]["finish_reason"] == {"type": "length", "length": 12}, prompt
        assert final["output_ids"] == want["output_ids"], prompt
        assert final["text"] == want["text"], prompt
        texts = [c["text"] for c in chunks]
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:])), prompt
    state = wait_idle(live_server)
    assert state["integrity"] == "ok" and state["num_used_tokens"] == 0


def _generation_tokens(url) -> float:
    for line in requests.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("sglang:generation_tokens_total"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_disconnect_mid_stream_frees_the_pool(live_server):
    idle = wait_idle(live_server)["num_used_tokens"]
    before = _generation_tokens(live_server)
    resp = requests.post(live_server + "/generate", stream=True, timeout=60, json={
        "text": "A very long story begins", "stream": True,
        "sampling_params": {"max_new_tokens": 900, "ignore_eos": True}})
    lines = resp.iter_lines()
    got = 0
    for line in lines:
        if line.startswith(b"data: "):
            got += 1
            if got == 3:
                break
    assert internal_state(live_server)["num_running_reqs"] == 1
    resp.close()  # the client goes away mid-stream
    t0 = time.monotonic()
    state = wait_idle(live_server, timeout=20)
    assert time.monotonic() - t0 < 20
    assert state["integrity"] == "ok"
    assert state["num_used_tokens"] == idle
    assert _generation_tokens(live_server) - before < 900  # it was aborted, not run to the end
    assert requests.get(live_server + "/health", timeout=30).status_code == 200
