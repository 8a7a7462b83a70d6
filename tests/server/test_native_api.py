"""The SGLang-native routes of a live server, over plain HTTP."""

import json
import threading
import time

import pytest
import requests

from server_harness import internal_state, wait_idle

GREEDY = {"temperature": 0, "max_new_tokens": 8}


def post(url, path, body, **kw):
    return requests.post(url + path, json=body, timeout=60, **kw)


def sse_events(resp):
    """Parsed `data:` payloads of an SSE response, `[DONE]` included as the string."""
    events = []
    for line in resp.iter_lines(decode_unicode=True):
        if line and line.startswith("data: "):
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def test_generate_single(live_server):
    r = post(live_server, "/generate", {"text": "Hello world", "sampling_params": GREEDY, "rid": "single-1"})
    assert r.status_code == 200
    out = r.json()
    assert set(out) >= {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    assert meta["id"] == "single-1"
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    assert meta["completion_tokens"] == len(out["output_ids"]) == 8
    for key in ("prompt_tokens", "cached_tokens", "e2e_latency", "weight_version", "num_retractions"):
        assert key in meta
    detok = post(live_server, "/detokenize", {"tokens": out["output_ids"]}).json()["text"]
    assert detok == out["text"]


def test_generate_batch_and_input_ids(live_server):
    prompts = ["Hello world", "The quick brown fox", "1, 2, 3,"]
    outs = post(live_server, "/generate", {"text": prompts, "sampling_params": GREEDY, "rid": "b"}).json()
    assert isinstance(outs, list) and len(outs) == 3
    assert [o["meta_info"]["id"] for o in outs] == ["b_0", "b_1", "b_2"]
    ids = post(live_server, "/tokenize", {"prompt": prompts[1]}).json()["tokens"]
    single = post(live_server, "/generate", {"input_ids": ids, "sampling_params": GREEDY}).json()
    assert single["output_ids"] == outs[1]["output_ids"]
    per_item = post(live_server, "/generate", {
        "text": prompts[:2], "sampling_params": [{**GREEDY, "max_new_tokens": 2}, {**GREEDY, "max_new_tokens": 3}],
    }).json()
    assert [len(o["output_ids"]) for o in per_item] == [2, 3]


def test_generate_n_and_cache_salt(live_server):
    outs = post(live_server, "/generate", {"text": "Once upon a time", "cache_salt": "tenant-a",
                                           "sampling_params": {"max_new_tokens": 4, "n": 3}}).json()
    assert len(outs) == 3 and all(len(o["output_ids"]) == 4 for o in outs)
    again = post(live_server, "/generate", {"text": "Once upon a time", "cache_salt": "tenant-a",
                                            "sampling_params": GREEDY}).json()
    assert again["meta_info"]["cached_tokens"] > 0


def test_generate_stream_cumulative(live_server):
    r = requests.post(live_server + "/generate", json={"text": "Hello", "stream": True, "sampling_params": GREEDY},
                      stream=True, timeout=60)
    assert r.headers["Content-Type"].startswith("text/event-stream")
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) >= 2
    for a, b in zip(chunks, chunks[1:]):
        assert b["text"].startswith(a["text"])
        assert b["output_ids"][:len(a["output_ids"])] == a["output_ids"]
    final = chunks[-1]
    assert final["meta_info"]["finish_reason"]["type"] == "length"
    whole = post(live_server, "/generate", {"text": "Hello", "sampling_params": GREEDY}).json()
    assert final["text"] == whole["text"] and final["output_ids"] == whole["output_ids"]


def test_generate_stream_batch_has_index(live_server):
    r = requests.post(live_server + "/generate", json={"text": ["a", "b"], "stream": True,
                                                       "sampling_params": {**GREEDY, "max_new_tokens": 3}},
                      stream=True, timeout=60)
    chunks = sse_events(r)[:-1]
    assert {c["index"] for c in chunks} == {0, 1}


def test_logprobs(live_server):
    out = post(live_server, "/generate", {
        "text": "The capital of France", "sampling_params": {**GREEDY, "max_new_tokens": 4},
        "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2,
        "return_text_in_logprobs": True}).json()
    meta = out["meta_info"]
    assert len(meta["output_token_logprobs"]) == meta["output_token_logprobs_length"] == 4
    lp, tok, text = meta["output_token_logprobs"][0]
    assert tok == out["output_ids"][0] and lp <= 0 and isinstance(text, str)
    first = meta["input_token_logprobs"][0]
    assert first is None or first[0] is None  # no predecessor for the first prompt token
    assert len(meta["input_token_logprobs"]) == meta["prompt_tokens"]
    assert all(len(top) == 2 for top in meta["output_top_logprobs"])
    # greedy: the chosen token is the top-1 alternative
    assert meta["output_top_logprobs"][0][0][1] == tok


def test_abort_request(live_server):
    result = {}

    def run():
        result["r"] = post(live_server, "/generate", {
            "text": "abort me", "rid": "to-abort",
            "sampling_params": {"max_new_tokens": 900, "ignore_eos": True}})

    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 30
    while internal_state(live_server)["num_running_reqs"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert post(live_server, "/abort_request", {"rid": "to-abort"}).status_code == 200
    t.join(30)
    out = result["r"].json()
    assert result["r"].status_code == 200
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(out["output_ids"]) < 900
    state = wait_idle(live_server)
    assert state["integrity"] == "ok" and state["num_used_tokens"] == 0


@pytest.mark.parametrize("body, fragment", [
    ({"text": "hi", "sampling_params": {"temperature": -1}}, "temperature"),
    ({"text": "hi", "sampling_params": {"top_p": 0}}, "top_p"),
    ({"text": "hi", "sampling_params": {"max_new_tokens": "ten"}}, "max_new_tokens"),
    ({"text": "hi", "sampling_params": {"bogus": 1}}, "bogus"),
    ({"text": "hi", "sampling_params": "greedy"}, "sampling_params"),
    ({"text": "hi", "frobnicate": True}, "frobnicate"),
    ({"text": 42}, "text"),
    ({"input_ids": []}, "input_ids: expected at least 1 item"),
    ({"input_ids": ["a"]}, "input_ids"),
    ({"input_ids": [10 ** 9]}, "input_ids[0]: expected a token id in [0, 49151] (the vocabulary)"),
    ({"text": ""}, "empty"),
    ({"sampling_params": {}}, "text, input_ids"),
    ({"input_ids": [5] * 2000}, "context length"),
    ({"text": ["a", "b"], "rid": ["x", "x"]}, "Duplicate"),
    ({"text": "hi", "sampling_params": {"stop": 5}}, "stop"),
])
def test_bad_generate_is_400(live_server, body, fragment):
    r = post(live_server, "/generate", body)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert fragment.lower() in message.lower(), message


@pytest.mark.parametrize("raw", [b"{not json", b"", b"[1, 2]", b"\xff\xfe"])
def test_malformed_body_is_400(live_server, raw):
    r = requests.post(live_server + "/generate", data=raw, timeout=30)
    assert r.status_code == 400
    assert r.json()["error"]["message"]


def test_health_and_info(live_server):
    assert requests.get(live_server + "/health", timeout=30).status_code == 200
    assert requests.get(live_server + "/health_generate", timeout=30).status_code == 200
    for path in ("/get_model_info", "/model_info"):
        info = requests.get(live_server + path, timeout=30).json()
        assert info["is_generation"] is True and info["model_path"]
        assert info["served_model_name"]
    info = requests.get(live_server + "/get_server_info", timeout=30).json()
    assert info["port"] == int(live_server.rsplit(":", 1)[1])
    assert info["max_total_num_tokens"] == 8192
    assert info["internal_states"][0]["max_total_num_tokens"] == 8192
    assert "version" in info
    assert requests.get(live_server + "/server_info", timeout=30).status_code == 200


def test_flush_cache(live_server):
    wait_idle(live_server)
    r = requests.post(live_server + "/flush_cache", timeout=30)
    assert r.status_code == 200 and r.text.startswith("Cache flushed.")
    assert internal_state(live_server)["cached_tokens"] == 0


def test_freeze_gc(live_server):
    """Collections are counted per generation; /freeze_gc freezes the scheduler's live objects."""
    assert len(internal_state(live_server)["gc_collections"]) == 3
    r = requests.post(live_server + "/freeze_gc", timeout=30)
    assert r.status_code == 200 and r.text == "Garbage collection frozen."
    assert internal_state(live_server)["gc_frozen_objects"] > 1000


def test_tokenize_detokenize(live_server):
    r = post(live_server, "/tokenize", {"prompt": "Hello world"}).json()
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == 1024
    assert post(live_server, "/detokenize", {"tokens": r["tokens"]}).json()["text"] == "Hello world"
    chat = post(live_server, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > r["count"]
    assert post(live_server, "/detokenize", {"tokens": ["x"]}).status_code == 400


def test_metrics(live_server):
    post(live_server, "/generate", {"text": "metrics", "sampling_params": GREEDY})
    body = requests.get(live_server + "/metrics", timeout=30).text
    for name in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage",
                 "sglang:cache_hit_rate", "sglang:prompt_tokens_total", "sglang:generation_tokens_total",
                 "sglang:time_to_first_token_seconds_bucket", "sglang:inter_token_latency_seconds_bucket"):
        assert name in body, name


def test_openapi_lists_every_route(live_server):
    doc = requests.get(live_server + "/openapi.json", timeout=30).json()
    assert doc["openapi"].startswith("3.")
    paths = doc["paths"]
    for path in ("/generate", "/health", "/v1/completions", "/v1/chat/completions", "/metrics", "/flush_cache"):
        assert path in paths
    undocumented = [p for p, ops in paths.items() for op in ops.values() if op["summary"] == "(undocumented)"]
    assert not undocumented
    # the published bodies are the very schemas the boundary checks with
    body = paths["/generate"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert "sampling_params" in body["properties"]
    chat = paths["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert chat["required"] == ["messages"]
    assert "400" in paths["/generate"]["post"]["responses"]


def test_unknown_route_is_json_404(live_server):
    r = requests.get(live_server + "/nope", timeout=30)
    assert r.status_code == 404 and "error" in r.json()


def test_server_healthy_and_clean_after_everything(live_server):
    """Runs last in this module: bad input left no leak and the server still answers."""
    assert requests.get(live_server + "/health", timeout=30).status_code == 200
    state = wait_idle(live_server)
    assert state["integrity"] == "ok" and state["num_used_tokens"] == 0
