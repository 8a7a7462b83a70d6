"""Tool calling on `/v1/chat/completions`, with the official `openai` client.

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {...}}}]
    r = client.chat.completions.create(model=m, messages=[...], tools=tools, tool_choice="required")
    call = r.choices[0].message.tool_calls[0]         # finish_reason "tool_calls"
    json.loads(call.function.arguments)               # always follows the tool's parameters schema
    messages += [r.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": "18C"}]

- `tool_choice: "required"` or `{"type": "function", "function": {"name": ...}}` constrains the
  answer to the tools' argument schemas (any model, any `--tool-call-parser`);
- `tool_choice: "auto"` (the default with tools) reads calls with `--tool-call-parser`
  (json, pythonic, llama3, qwen25); the session's live server runs with `qwen25`;
- streamed, calls arrive as `delta.tool_calls` once complete.
The parsers themselves are checked on text below, without a model.
"""

import json

import jsonschema
import openai
import pytest

from lmprog_runtime.server.tools import content_prefix_len, parse_tool_calls, plan_tools
from lmprog_runtime.generate_request import RequestError

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"], "properties": {
    "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
    "unit": {"type": "string", "enum": ["C", "F"]}}}
TIME = {"type": "object", "additionalProperties": False, "required": ["zone"], "properties": {
    "zone": {"type": "string", "enum": ["UTC", "CET"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Time in a zone",
                                           "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(live_server):
    return openai.OpenAI(base_url=live_server + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def check_calls(calls):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


# -- against the live server --------------------------------------------------------------------
def test_required_tool_choice_always_gives_valid_calls(client, model):
    r = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                       max_tokens=200, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    check_calls(choice.message.tool_calls)


def test_named_function_and_no_parallel_calls(client, model):
    r = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, max_tokens=200, temperature=0,
                                       tool_choice={"type": "function", "function": {"name": "get_time"}})
    calls = r.choices[0].message.tool_calls
    check_calls(calls)
    assert [c.function.name for c in calls] == ["get_time"]
    r = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=200, temperature=0)
    assert len(r.choices[0].message.tool_calls) == 1


def test_a_tool_message_round_trip(client, model):
    first = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                           max_tokens=200, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    messages = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}]
    second = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=8,
                                            temperature=0)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert second.usage.prompt_tokens > first.usage.prompt_tokens  # the call and its result are in the prompt


def test_streamed_calls_match_the_unstreamed_ones(client, model):
    kwargs = dict(model=model, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=200, temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    calls, finish = {}, None
    for event in client.chat.completions.create(stream=True, **kwargs):
        for choice in event.choices:
            for delta in choice.delta.tool_calls or []:
                calls.setdefault(delta.index, [delta.function.name, ""])
                calls[delta.index][1] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    assert [calls[i] for i in sorted(calls)] == [[c.function.name, c.function.arguments] for c in whole]


def test_auto_reads_calls_with_the_servers_parser(client, model):
    r = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, max_tokens=8, temperature=0)
    choice = r.choices[0]  # random weights write no <tool_call>: plain content, no calls
    assert choice.message.tool_calls is None and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")


def test_tool_errors_name_the_field(client, model):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, max_tokens=8,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    assert "tool_choice.function.name" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                       max_tokens=8, response_format={"type": "json_object"})
    assert "cannot be combined" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=ASK, tools=[{"type": "function"}], max_tokens=8)
    assert e.value.body["param"] == "tools[0].function"


# -- the parsers, on text ------------------------------------------------------------------------
@pytest.mark.parametrize("parser, text, content", [
    ("json", '{"name": "get_time", "arguments": {"zone": "UTC"}}', ""),
    ("json", '[{"name": "get_time", "parameters": {"zone": "UTC"}}]', ""),
    ("qwen25", 'Let me check.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>',
     "Let me check."),
    ("llama3", '<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}', ""),
    ("llama3", '{"name": "get_time", "parameters": {"zone": "UTC"}}', ""),
    ("pythonic", '[get_time(zone="UTC")]', ""),
])
def test_each_parser_reads_its_format(parser, text, content):
    found_content, calls = parse_tool_calls(text, parser)
    assert found_content == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_time", {"zone": "UTC"})]


@pytest.mark.parametrize("parser", ["json", "qwen25", "llama3", "pythonic"])
def test_text_without_a_call_is_all_content(parser):
    assert parse_tool_calls("The weather is fine.", parser) == ("The weather is fine.", [])


def test_several_calls_and_malformed_ones():
    _, calls = parse_tool_calls('[get_time(zone="UTC"), get_weather(city="Oslo", unit="C")]', "pythonic")
    assert [c.name for c in calls] == ["get_time", "get_weather"]
    _, calls = parse_tool_calls('{"name": "a", "parameters": {}}; {"name": "b", "parameters": {}}', "llama3")
    assert [c.name for c in calls] == ["a", "b"]
    assert parse_tool_calls('<tool_call>\n{"name": "a", "arguments": {\n</tool_call>', "qwen25")[1] == []
    assert parse_tool_calls("[get_time(zone=now())]", "pythonic")[1] == []  # not a literal


def test_streaming_holds_back_only_what_may_be_a_call():
    assert content_prefix_len("Sure, <tool", "qwen25") == len("Sure, ")
    assert content_prefix_len("Sure, <tool_call>{", "qwen25") == len("Sure, ")
    assert content_prefix_len("Plain answer", "qwen25") == len("Plain answer")
    assert content_prefix_len('  {"name"', "json") == 0
    assert content_prefix_len("Plain answer", "pythonic") == len("Plain answer")


def test_plans():
    assert plan_tools({"tools": TOOLS, "tool_choice": "none"}, "qwen25") is None
    assert plan_tools({}, None) is None
    assert plan_tools({"tools": TOOLS}, "qwen25").constraint is None  # auto: the parser reads
    with pytest.raises(RequestError, match="--tool-call-parser"):
        plan_tools({"tools": TOOLS}, None)
    with pytest.raises(RequestError, match="needs a non-empty tools list"):
        plan_tools({"tool_choice": "required"}, "json")
    schema = json.loads(plan_tools({"tools": TOOLS, "tool_choice": "required"}, None).constraint)
    jsonschema.validate([{"name": "get_time", "arguments": {"zone": "UTC"}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "arguments": {"zone": "Mars"}}], schema)
