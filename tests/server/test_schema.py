"""The boundary's parts without a server: body parsing, the schema checker, the published
schemas (valid JSON Schema, and agreeing with `jsonschema` on what they accept), and the
grammar compile budget."""

import gzip
import json

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmprog_runtime.constrained.base import GrammarError
from lmprog_runtime.constrained.budget import check_regex_budget, check_spec_size
from lmprog_runtime.sampling_params import SamplingParams
from lmprog_runtime.server.schema import Limits, request_schemas
from lmprog_runtime.server.validate import SchemaError, decompress, parse_body, validate
from lmprog_runtime.generate_request import RequestError

LIM = Limits(vocab_size=1000)
SCHEMAS = request_schemas(LIM)


def test_parse_body_rejects():
    for raw, fragment in [(b"", "empty"), (b"  ", "empty"), (b"{", "Malformed"), (b'{"a": NaN}', "finite"),
                          (b'{"a": -Infinity}', "finite"), (b'"\xff"', "UTF-8"), (b"[" * 5000 + b"]" * 5000, "deeper"),
                          (b'{"k": "\\udc00"}', "surrogates"), (b'{"\\ud800": 1}', "surrogates")]:
        with pytest.raises(RequestError, match=fragment):
            parse_body(raw, max_depth=64)
    assert parse_body(b"[" * 64 + b"]" * 64, max_depth=64) is not None
    with pytest.raises(RequestError, match="deeper than 64"):
        parse_body(b"[" * 65 + b"]" * 65, max_depth=64)
    assert parse_body('{"t": "\U0001f642 \u202e \\u0000"}'.encode(), 64) == {"t": "\U0001f642 \u202e \x00"}


def test_decompress():
    assert decompress(gzip.compress(b"abc"), "gzip", 100) == b"abc"
    assert decompress(b"abc", "identity", 100) == b"abc"
    with pytest.raises(RequestError, match="not valid gzip"):
        decompress(b"abc", "gzip", 100)
    with pytest.raises(RequestError) as e:
        decompress(gzip.compress(b"x" * 1000), "gzip", 100)
    assert e.value.status == 413
    with pytest.raises(RequestError, match="truncated"):
        decompress(gzip.compress(b"x" * 1000)[:-10], "gzip", 10_000)
    with pytest.raises(RequestError) as e:
        decompress(b"abc", "br", 100)
    assert e.value.status == 415


@pytest.mark.parametrize("body, path, expected", [
    ({"text": 5}, "text", "a string or a list"),
    ({"input_ids": [1, 2, 1000]}, "input_ids[2]", "a token id in [0, 999]"),
    ({"input_ids": [[1], [2, -3]]}, "input_ids[1][1]", "a token id"),
    ({"text": "x", "sampling_params": {"n": 65}}, "sampling_params.n", "an integer in [1, 64]"),
    ({"text": "x", "sampling_params": {"logit_bias": {"x1": 1}}}, 'sampling_params.logit_bias.x1', "decimal"),
    ({"text": "x", "sampling_params": {"top_p": 1.5}}, "sampling_params.top_p", "a number in (0, 1]"),
    ({"text": "x", "sampling_params": {"stop": ["a"] * 33}}, "sampling_params.stop", "at most 32 items"),
    ({"text": "x", "sampling_params": [{"n": 1}, 5]}, "sampling_params[1]", "an object"),
    ({"text": "x", "sampling_params": {"regex": "a**"}}, "sampling_params.regex", "Python regular expression"),
    ({"text": "x", "unknown": 1}, "unknown", "a known field"),
])
def test_generate_schema_errors(body, path, expected):
    with pytest.raises(SchemaError) as e:
        validate(body, SCHEMAS["/generate"])
    assert e.value.path == path and expected in e.value.expected, str(e.value)
    assert str(e.value).startswith(f"{path}: expected ")


def test_null_means_unset_and_ignored_fields_pass():
    validate({"text": "x", "rid": None, "sampling_params": {"max_new_tokens": None}, "lora_path": [1]},
             SCHEMAS["/generate"])
    with pytest.raises(SchemaError, match="required"):
        validate({"messages": None}, SCHEMAS["/v1/chat/completions"])


def test_published_schemas_are_valid_json_schema():
    for path, schema in SCHEMAS.items():
        jsonschema.Draft202012Validator.check_schema(schema)


def _strip_nulls(value):
    if isinstance(value, dict):
        return {k: _strip_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_strip_nulls(v) for v in value]
    return value


leaves = st.one_of(st.none(), st.booleans(), st.integers(-3, 1003), st.sampled_from([0.5, 1.0, 150.0, -2.5]),
                   st.sampled_from(["", "a", "5", "HEALTH_CHECK", "[a-z]+", "user"]))
values = st.recursive(leaves, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                      st.dictionaries(st.sampled_from(["5", "n", "x"]), inner,
                                                                      max_size=2)), max_leaves=6)
fields = {"/generate": ["text", "input_ids", "sampling_params", "rid", "stream", "cache_salt"],
          "/v1/completions": ["prompt", "n", "max_tokens", "logit_bias", "stop", "seed", "echo"],
          "/v1/chat/completions": ["messages", "logprobs", "top_logprobs", "tool_choice", "stop"]}


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(st.sampled_from(sorted(fields)), st.data())
def test_checker_agrees_with_jsonschema(path, data):
    """What we accept, a standard validator accepts too (nulls = unset removed first), so
    the OpenAPI document does not promise less than the server checks."""
    keys = fields[path]
    body = data.draw(st.dictionaries(st.sampled_from(keys), values, max_size=4))
    if path == "/generate" and isinstance(body.get("sampling_params"), dict):
        body["sampling_params"] = data.draw(st.dictionaries(
            st.sampled_from(["n", "top_p", "logit_bias", "stop", "max_new_tokens"]), values, max_size=3))
    try:
        validate(body, SCHEMAS[path])
    except SchemaError:
        return
    jsonschema.validate(_strip_nulls(body), SCHEMAS[path], cls=jsonschema.Draft202012Validator)


def test_sampling_params_guard_the_scheduler():
    """In-process callers (Engine) get the same refusals for what would crash the scheduler."""
    for d, fragment in [({"sampling_seed": 1 << 64}, "sampling_seed"), ({"logit_bias": {"5": float("nan")}}, "logit_bias"),
                        ({"logit_bias": {"5": "1"}}, "logit_bias"), ({"stream_interval": "2"}, "stream_interval"),
                        ({"skip_special_tokens": "no"}, "skip_special_tokens"), ({"ignore_eos": 1}, "ignore_eos"),
                        ({"regex": "\\p{L}"}, "regular expression"), ({"custom_params": [1]}, "custom_params")]:
        with pytest.raises(ValueError, match=fragment):
            SamplingParams.from_dict(d).verify(1000)
    assert SamplingParams.from_dict({"sampling_seed": (1 << 63) - 1, "logit_bias": {"5": -100}}).sampling_seed


def test_compile_budget():
    check_regex_budget("regex", "[a-z]{1,100}(,[a-z]{1,100}){0,50}", 100_000)
    for regex in ("a{1000000}", "(ab{1000}){1000}", "x{100001}"):
        with pytest.raises(GrammarError, match="compile budget"):
            check_regex_budget("regex", regex, 100_000)
    with pytest.raises(GrammarError, match="Python `re` syntax"):
        check_regex_budget("regex", "a**", 100_000)
    check_regex_budget("json", "a**", 100_000)  # our own translation's dialect: not judged by Python's
    with pytest.raises(GrammarError, match="65536 bytes"):
        check_spec_size("json", json.dumps({"enum": ["x" * 70_000]}), 65536)


def test_engine_path_refuses_unhashable_cache_salt(tiny_engine):
    """In-process callers skip the HTTP schema; the TokenizerManager still refuses these."""
    for key in ("cache_salt", "extra_key"):
        with pytest.raises(RequestError, match=key):
            tiny_engine.generate("hi", {"max_new_tokens": 1}, **{key: ["a"]})
    assert tiny_engine.generate("hi", {"max_new_tokens": 1}, cache_salt="a")["meta_info"]["completion_tokens"] == 1
