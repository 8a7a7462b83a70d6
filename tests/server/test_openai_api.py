"""The OpenAI-compatible routes, driven by the official `openai` client (and raw HTTP for errors)."""

import json

import openai
import pytest
import requests

from server_harness import wait_idle

CHAT = [{"role": "user", "content": "Say hi"}]


@pytest.fixture(scope="module")
def client(live_server):
    return openai.OpenAI(base_url=live_server + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def test_models(client, live_server, model):
    card = client.models.retrieve(model)
    assert card.id == model
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    raw = requests.get(live_server + "/v1/models", timeout=30).json()
    assert raw["object"] == "list" and raw["data"][0]["max_model_len"] == 1024


def test_completion(client, model, live_server):
    r = client.completions.create(model=model, prompt="Hello world", max_tokens=6, temperature=0)
    assert r.object == "text_completion"
    assert len(r.choices) == 1 and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 6 and r.usage.total_tokens == r.usage.prompt_tokens + 6
    native = requests.post(live_server + "/generate", json={
        "text": "Hello world", "sampling_params": {"max_new_tokens": 6, "temperature": 0}}, timeout=60).json()
    assert r.choices[0].text == native["text"]


def test_completion_batch_n_echo_logprobs(client, model):
    r = client.completions.create(model=model, prompt=["Hello there", "The sky is"], max_tokens=3,
                                  n=2,
                                  logprobs=2, echo=True)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text.startswith("Hello there") and r.choices[2].text.startswith("The sky is")
    lp = r.choices[0].logprobs
    assert lp.token_logprobs[0] is None  # echoed first prompt token
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs)
    assert all(len(t) <= 2 for t in lp.top_logprobs[1:])
    assert r.usage.completion_tokens == 12


def test_completion_token_prompt_and_stop(client, model, live_server):
    ids = requests.post(live_server + "/tokenize", json={"prompt": "Hello world"}, timeout=30).json()["tokens"]
    base = client.completions.create(model=model, prompt=ids, max_tokens=12, temperature=0)
    text = base.choices[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    if stop.strip():
        r = client.completions.create(model=model, prompt=ids, max_tokens=12, temperature=0, stop=[stop])
        assert r.choices[0].finish_reason == "stop"
        assert r.choices[0].matched_stop == stop
        assert r.choices[0].text == text[:text.index(stop)]


def test_completion_stream(client, model):
    chunks = list(client.completions.create(model=model, prompt="Hello", max_tokens=5, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    full = client.completions.create(model=model, prompt="Hello", max_tokens=5, temperature=0)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 5 and not chunks[-1].choices


def test_chat(client, model):
    r = client.chat.completions.create(model=model, messages=CHAT, max_tokens=5, temperature=0)
    assert r.object == "chat.completion"
    msg = r.choices[0].message
    assert msg.role == "assistant" and isinstance(msg.content, str)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5


def test_chat_n_and_logprobs(client, model):
    r = client.chat.completions.create(model=model, messages=CHAT, max_completion_tokens=4, n=3,
                                       logprobs=True, top_logprobs=3, seed=7)
    assert len(r.choices) == 3 and [c.index for c in r.choices] == [0, 1, 2]
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    assert all(len(item.top_logprobs) == 3 and item.logprob <= 0 for item in content)
    assert "".join(item.token for item in content) == r.choices[0].message.content
    assert r.usage.completion_tokens == 12


def test_chat_stream(client, model):
    stream = client.chat.completions.create(model=model, messages=CHAT, max_tokens=6, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    full = client.chat.completions.create(model=model, messages=CHAT, max_tokens=6, temperature=0)
    assert text == full.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].usage.completion_tokens == 6


def test_chat_stream_n(client, model):
    chunks = list(client.chat.completions.create(model=model, messages=CHAT, max_tokens=3, n=2, stream=True))
    roles = [c.choices[0].index for c in chunks if c.choices[0].delta.role == "assistant"]
    assert sorted(roles) == [0, 1]


SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "x", "schema": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}


def test_response_format_reaches_the_scheduler(client, model):
    for fmt in ({"type": "json_object"}, SCHEMA_FORMAT):
        r = client.chat.completions.create(model=model, messages=CHAT, max_tokens=40, response_format=fmt,
                                           logprobs=True)
        generated = "".join(item.token for item in r.choices[0].logprobs.content)
        assert generated.lstrip().startswith("{"), generated  # constrained, not free text


def test_response_format_json_schema_output_parses(client, model):
    # A closed schema with a bounded value: at most 5 runs of 16 whitespace characters and
    # 8 others, so 120 tokens always reach the end of the object and the check always runs.
    closed = {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "integer", "enum": [1, 22, 333]}},
        "required": ["a"], "additionalProperties": False}}}
    r = client.chat.completions.create(model=model, messages=CHAT, max_tokens=120, response_format=closed)
    assert r.choices[0].finish_reason == "stop", r.choices[0]
    assert json.loads(r.choices[0].message.content)["a"] in (1, 22, 333)


@pytest.mark.parametrize("path, body, fragment", [
    ("/v1/completions", {"prompt": "", "max_tokens": 2}, "prompt: expected a non-empty string"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens: expected an integer in [1, "),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "2"}, "max_tokens: expected an integer"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, "temperature: expected a number"),
    ("/v1/completions", {"prompt": "hi", "top_p": 5}, "top_p"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, "n: expected an integer in [1, 64], got 0"),
    ("/v1/completions", {"prompt": [1.5]}, "prompt"),
    ("/v1/completions", {"prompt": "x " * 3000, "max_tokens": 2}, "context length"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "content"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 3}, "logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "xml"}}, "response_format"),
])
def test_bad_openai_requests_are_400(live_server, path, body, fragment):
    r = requests.post(live_server + path, json={"model": "x", **body}, timeout=30)
    assert r.status_code == 400, r.text
    assert fragment.lower() in r.json()["error"]["message"].lower()


def test_openai_requires_json_content_type(live_server):
    r = requests.post(live_server + "/v1/completions", data="prompt=hi", timeout=30,
                      headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert r.status_code == 415 and "application/json" in r.json()["error"]["message"]


def test_client_sees_bad_request(client, model):
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.completions.create(model=model, prompt="hi", top_p=0)


def test_idle_and_intact_afterwards(live_server):
    state = wait_idle(live_server)
    assert state["integrity"] == "ok" and state["num_used_tokens"] == 0
