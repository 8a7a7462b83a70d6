"""OpenAI request fields that clients send by default, each doing what OpenAI documents:

- `logit_bias` {token id: -100..100} shifts those tokens' logits (+100 forces, -100 bans);
- `seed` makes sampling reproducible; `user` is accepted (an end-user id, not used);
- `stream_options.include_usage` adds a final chunk with `usage` and no choices;
- `max_completion_tokens` (chat) caps the answer like the deprecated `max_tokens`;
- `response_format: {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`;
- `parallel_tool_calls` (see test_tool_calling.py);
- errors are `{"error": {"message", "type", "param", "code"}}`, which the official client
  turns into `openai.BadRequestError` with `.message`, `.type`, `.param`, `.code`.
"""

import json

import jsonschema
import openai
import pytest
import requests

CHAT = [{"role": "user", "content": "Say hi"}]


@pytest.fixture(scope="module")
def client(live_server):
    return openai.OpenAI(base_url=live_server + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def test_logit_bias_forces_and_bans_tokens(client, model, live_server):
    token = requests.post(live_server + "/tokenize", json={"prompt": " yes"}, timeout=30).json()["tokens"][-1]
    r = client.completions.create(model=model, prompt="Hello", max_tokens=4, temperature=0,
                                  logit_bias={str(token): 100})
    assert r.choices[0].text == " yes" * 4
    greedy = requests.post(live_server + "/generate", json={"text": "Hello", "sampling_params": {
        "max_new_tokens": 1, "temperature": 0}}, timeout=30).json()
    banned = client.completions.create(model=model, prompt="Hello", max_tokens=1, temperature=0,
                                       logit_bias={str(greedy["output_ids"][0]): -100})
    assert banned.choices[0].text != greedy["text"]  # the greedy token is out: the next best comes


def test_seed_makes_sampling_reproducible_and_user_is_accepted(client, model):
    kwargs = dict(model=model, prompt="Once upon a time", max_tokens=12, temperature=1.0, user="user-42")
    a = client.completions.create(seed=7, **kwargs).choices[0].text
    assert client.completions.create(seed=7, **kwargs).choices[0].text == a
    others = {client.completions.create(seed=s, **kwargs).choices[0].text for s in (8, 9, 10)}
    assert others != {a}


@pytest.mark.parametrize("chat", [True, False])
def test_include_usage_adds_a_usage_chunk(client, model, chat):
    kwargs = dict(model=model, max_tokens=5, temperature=0, stream=True, stream_options={"include_usage": True})
    events = list(client.chat.completions.create(messages=CHAT, **kwargs) if chat
                  else client.completions.create(prompt="Hello", **kwargs))
    assert all(e.usage is None for e in events[:-1])
    last = events[-1]
    assert last.choices == [] and last.usage.completion_tokens == 5
    assert last.usage.total_tokens == last.usage.prompt_tokens + 5


def test_max_completion_tokens(client, model):
    r = client.chat.completions.create(model=model, messages=CHAT, max_completion_tokens=3, temperature=0)
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


def test_response_format_json_schema_with_strict(client, model):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    r = client.chat.completions.create(model=model, messages=CHAT, max_tokens=40, temperature=0,
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "answer", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_parallel_tool_calls_is_a_known_field(live_server):
    body = {"messages": CHAT, "max_tokens": 2, "parallel_tool_calls": "yes"}
    r = requests.post(live_server + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "parallel_tool_calls"


def test_the_official_client_reads_the_error_envelope(client, model):
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.chat.completions.create(model=model, messages=CHAT, max_tokens=2, temperature=-1)
    err = excinfo.value
    assert err.status_code == 400 and err.type == "invalid_request_error" and err.param == "temperature"
    assert str(err.code) == "400" and "temperature" in err.message  # the client reads code as a string
    assert set(err.body) == {"message", "type", "param", "code"}
