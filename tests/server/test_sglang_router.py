"""lmprog servers as workers of SGLang's real router (PyPI sglang-router, the Rust gateway):
two workers on the tiny model behind `python -m sglang_router.launch_router`. Greedy answers
through the router equal a direct worker's (native /generate, streaming, OpenAI completions
and chat); cache_aware keeps a repeated long prefix on one worker (cached_tokens); the
router's /flush_cache reaches both workers."""

import json
import threading

import pytest
import requests

pytest.importorskip("sglang_router", reason="sglang-router is not installed (pip install sglang-router)")

from bench.baselines.servers import SglangRouter  # noqa: E402
from server_harness import LiveServer, free_port, wait_idle  # noqa: E402

GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def cluster(tiny_model_path, tmp_path_factory):
    logs = tmp_path_factory.mktemp("router")
    workers = [LiveServer(tiny_model_path, logs) for _ in range(2)]
    errors = []
    threads = [threading.Thread(target=lambda w=w: _start(w, errors)) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    router = SglangRouter(free_port(), [w.url for w in workers], policy="cache_aware",
                          log_path=str(logs / "router.log"), ready_timeout=120)
    try:
        assert not errors, errors
        yield router.__enter__(), [w.url for w in workers]
    finally:
        router.stop()
        for w in workers:
            w.stop()


def _start(worker, errors):
    try:
        worker.start()
    except Exception as e:  # noqa: BLE001 - reported by the fixture
        errors.append(e)


def _post(url, path, body):
    r = requests.post(url + path, json=body, timeout=120)
    assert r.status_code == 200, (path, r.status_code, r.text)
    return r


def _sse(resp):
    return [json.loads(line[6:]) for line in resp.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def test_generate_through_router_equals_direct(cluster):
    router, workers = cluster
    for text in ("The quick brown fox", "1 2 3"):
        body = {"text": text, "sampling_params": GREEDY}
        via, direct = _post(router, "/generate", body).json(), _post(workers[0], "/generate", body).json()
        assert via["output_ids"] == direct["output_ids"] and via["text"] == direct["text"]
        assert via["meta_info"]["completion_tokens"] == 8
        stream = _sse(_post(router, "/generate", {**body, "stream": True}))
        assert stream[-1]["output_ids"] == direct["output_ids"] and stream[-1]["text"] == direct["text"]
        assert stream[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_openai_routes_through_router_equal_direct(cluster):
    router, workers = cluster
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 6,
            "temperature": 0}
    via, direct = _post(router, "/v1/chat/completions", chat).json(), _post(workers[1], "/v1/chat/completions",
                                                                            chat).json()
    assert via["choices"][0]["message"]["content"] == direct["choices"][0]["message"]["content"]
    assert via["object"] == "chat.completion" and via["usage"] == direct["usage"]
    comp = {"model": "tiny", "prompt": "Once upon", "max_tokens": 6, "temperature": 0}
    direct = _post(workers[0], "/v1/completions", comp).json()["choices"][0]["text"]
    chunks = _sse(_post(router, "/v1/completions", {**comp, "stream": True}))
    assert "".join(c["choices"][0]["text"] for c in chunks) == direct
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    models = requests.get(router + "/v1/models", timeout=30).json()
    assert models["object"] == "list" and models["data"]


def test_cache_aware_keeps_a_long_prefix_on_one_worker(cluster):
    router, workers = cluster
    _post(router, "/flush_cache", {})
    prefix = "Chapter one. " + " ".join(f"line {i} of the shared document," for i in range(60))
    metas = [_post(router, "/generate", {"text": f"{prefix} Question {q}: why?",
                                         "sampling_params": {**GREEDY, "max_new_tokens": 2}}).json()["meta_info"]
             for q in range(4)]
    prompt = metas[0]["prompt_tokens"]
    assert prompt > 300 and metas[0]["cached_tokens"] == 0
    for m in metas[1:]:  # routed to the worker that holds the prefix: all of it is a hit
        assert m["cached_tokens"] >= prompt - 12, metas
    held = [wait_idle(w)["cached_tokens"] for w in workers]
    assert sorted(held)[0] == 0 and sorted(held)[1] >= prompt, held  # one worker has it all


def test_router_flush_reaches_both_workers(cluster):
    router, workers = cluster
    for i in range(4):
        _post(router, "/generate", {"text": f"warm {i} " * 20, "sampling_params": GREEDY})
    r = requests.post(router + "/flush_cache", timeout=60)
    assert r.status_code == 200, r.text
    assert [wait_idle(w)["cached_tokens"] for w in workers] == [0, 0]
    for w in workers:
        assert wait_idle(w)["integrity"] == "ok"


def test_router_fields_only_false(cluster):
    _, workers = cluster
    base = {"text": "hi", "sampling_params": {"max_new_tokens": 1}, "model": "tiny"}
    assert requests.post(workers[0] + "/generate", json={**base, "return_bytes": False}, timeout=60).ok
    r = requests.post(workers[0] + "/generate", json={**base, "return_entropy": True}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "return_entropy"
