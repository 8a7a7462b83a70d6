"""Hypothesis strategies for hostile requests to every endpoint, and the check of one answer.

A request is (method, path, body bytes, headers). Bodies mix well-formed fields with
random JSON (wrong types, boundary numbers, unicode with lone surrogates, NUL and RTL
marks, huge and deep values) and, sometimes, byte-level damage.
"""

from __future__ import annotations

import gzip
import json

from hypothesis import strategies as st

SPECIAL_TEXT = ["", "\x00", "\ud800", "a\udfffb", "\u202eevil\u202c", "\ufeff", "🙂" * 50, "\\", '"', "\n" * 30,
                "HEALTH_CHECK_x", "x" * 5000, "{" * 300, "a{1000000}", "\\p{L}", "a**"]
BOUNDARY_INTS = [0, 1, -1, 2, 63, 64, 65, 255, 256, 257, 1023, 1024, 49151, 49152, 2 ** 31, 2 ** 63 - 1,
                 2 ** 63, 2 ** 64, -(2 ** 63) - 1, 10 ** 30]
BOUNDARY_FLOATS = [0.0, -0.0, 1e-300, 0.5, 1.0, 2.0, 100.0, 100.0001, -100.5, 1e39, 1e308, -1e308]

TEXTS = st.one_of(st.sampled_from(SPECIAL_TEXT), st.text(max_size=40),
                  st.text(alphabet=st.characters(codec=None, exclude_categories=()), max_size=10))
PLAIN_TEXTS = st.one_of(st.sampled_from([t for t in SPECIAL_TEXT if t and not any(0xD800 <= ord(c) < 0xE000 for c in t)]),
                        st.text(min_size=1, max_size=40))
INTS = st.one_of(st.sampled_from(BOUNDARY_INTS), st.integers(-5, 70))
texts, ints = TEXTS, INTS
floats = st.one_of(st.sampled_from(BOUNDARY_FLOATS), st.floats(allow_nan=False, allow_infinity=False))
scalars = st.one_of(st.none(), st.booleans(), ints, floats, texts)
json_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(texts, inner, max_size=4)), max_leaves=12)


def deep(depth: int):
    return json.loads("[" * depth + "]" * depth) if depth < 900 else None


def rng(lo: float, hi: float):
    """Floats inside a documented range, its ends included."""
    return st.one_of(st.sampled_from([lo, hi]), st.floats(lo, hi))


def _bodies(junk: bool) -> dict:
    """Body strategies per path. junk=False: every field of a plausible type and range
    (the requests reach the scheduler); junk=True: each field sometimes random JSON."""
    def any_or(good):
        return st.one_of(good, good, json_values) if junk else good

    def pick(in_range, broad):
        return st.one_of(in_range, broad) if junk else in_range

    texts = TEXTS if junk else PLAIN_TEXTS
    ints = INTS if junk else st.one_of(st.sampled_from([0, 1, 63, 64, 2 ** 63 - 1, -(2 ** 63)]), st.integers(-5, 70))

    small_tokens = st.integers(1, 8)
    stop = st.one_of(texts, st.lists(texts, min_size=0 if junk else 1, max_size=40 if junk else 4))
    ids = st.lists(st.one_of(st.integers(0, 49151), ints) if junk else st.integers(0, 49151),
                   min_size=0 if junk else 1, max_size=6)
    logit_bias = st.dictionaries(st.one_of(st.integers(-2, 60000).map(str), texts) if junk
                                 else st.integers(0, 49151).map(str),
                                 pick(rng(-100, 100), st.one_of(floats, json_values)), max_size=3)
    grammar = st.one_of(st.sampled_from(["[a-z]{1,4}", "a{1000000}", "(", "a**", "\\d+", "[z-a]", "\\p{L}"]), texts)
    if not junk:
        grammar = st.sampled_from(["[a-z]{1,4}", "\\d+", "(yes|no)", "[^\\x00]{0,3}", "\\w+ \\w+"])
    json_schema = st.one_of(st.sampled_from([
        {"type": "string", "maxLength": 4}, {"type": "string", "minLength": 1000000},
        {"type": "integer"}, {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]},
        {"type": "array", "minItems": 100000}, {"$ref": "#/nope"}, {"type": "nonsense"}]), json_values)
    if not junk:
        json_schema = st.sampled_from([{"type": "string", "maxLength": 4}, {"type": "integer"}, {"enum": ["a", 1, None]},
                                       {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]},
                                       {"type": "array", "items": {"type": "number"}, "maxItems": 2}])

    SAMPLING = {
        "max_new_tokens": any_or(small_tokens), "min_new_tokens": any_or(st.integers(0, 3)),
        "temperature": pick(st.one_of(st.sampled_from([0, 0.7, 1.0]), rng(0, 1e6)), json_values),
        "top_p": pick(rng(1e-300, 1), json_values),
        "top_k": any_or(st.sampled_from([-1, 1, 5])), "min_p": pick(rng(0, 1), json_values),
        "frequency_penalty": pick(rng(-2, 2), floats), "presence_penalty": pick(rng(-2, 2), floats),
        "repetition_penalty": pick(rng(1e-6, 2), floats),
        "n": any_or(st.integers(1, 3)), "stop": any_or(stop), "stop_token_ids": any_or(ids),
        "stop_regex": any_or(grammar), "regex": grammar, "json_schema": st.one_of(json_schema, json_schema.map(json.dumps)),
        "ignore_eos": any_or(st.booleans()), "skip_special_tokens": any_or(st.booleans()),
        "no_stop_trim": any_or(st.booleans()), "stream_interval": any_or(st.integers(1, 3)),
        "logit_bias": any_or(logit_bias), "sampling_seed": ints, "seed": ints, "custom_params": json_values,
        "clamp_max_new_tokens": any_or(st.booleans()),
    }
    sampling = st.fixed_dictionaries({}, optional=SAMPLING)

    GENERATE = {
        "text": any_or(st.one_of(texts, st.lists(texts, max_size=3))), "input_ids": any_or(ids),
        "sampling_params": any_or(st.one_of(sampling, st.lists(sampling, max_size=3))),
        "rid": st.one_of(texts, st.lists(texts, max_size=3)) if junk else st.uuids().map(str), "stream": any_or(st.booleans()),
        "return_logprob": any_or(st.booleans()), "logprob_start_len": ints, "top_logprobs_num": ints if junk else st.integers(0, 20),
        "token_ids_logprob": any_or(ids), "return_text_in_logprobs": any_or(st.booleans()),
        "cache_salt": any_or(texts), "extra_key": any_or(texts), "return_prompt_token_ids": json_values if junk else st.booleans(),
        **({"bogus_field": json_values} if junk else {}),
    }
    OPENAI = {
        "model": any_or(texts), "n": any_or(st.integers(1, 3)), "stream": any_or(st.booleans()),
        "stream_options": any_or(st.fixed_dictionaries({"include_usage": any_or(st.booleans())})),
        "max_tokens": any_or(small_tokens), "temperature": any_or(st.sampled_from([0, 1])), "top_p": floats,
        "seed": ints, "stop": any_or(stop), "logit_bias": any_or(logit_bias), "user": json_values if junk else texts,
        "response_format": any_or(st.one_of(
            st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "xml"])}),
            st.fixed_dictionaries({"type": st.just("json_schema"),
                                   "json_schema": st.fixed_dictionaries({"schema": json_schema})}))),
        "regex": grammar, "ignore_eos": any_or(st.booleans()), "rid": texts if junk else st.uuids().map(str), "cache_salt": any_or(texts),
        "clamp_max_tokens": any_or(st.booleans()),
    }
    message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "wizard"] if junk else ["user", "system", "assistant"])},
                                    optional={"content": any_or(st.one_of(texts, st.lists(
                                        st.fixed_dictionaries({"type": st.just("text"), "text": texts}), max_size=2)))})
    COMPLETION = {**OPENAI, "prompt": any_or(st.one_of(texts, st.lists(texts, max_size=3), ids, st.lists(ids, max_size=2))),
                  "echo": any_or(st.booleans()), "logprobs": any_or(st.integers(0, 3))}
    CHAT = {**OPENAI, "messages": any_or(st.lists(message, max_size=3)), "logprobs": any_or(st.booleans()),
            "top_logprobs": any_or(st.integers(0, 3)), "max_completion_tokens": any_or(small_tokens),
            "tool_choice": json_values if junk else st.sampled_from(["none", "auto"]),
            "chat_template_kwargs": json_values if junk else st.just({}),
            "continue_final_message": json_values if junk else st.booleans()}
    TOKENIZE = {"prompt": any_or(st.one_of(texts, st.lists(texts, max_size=3))), "add_special_tokens": any_or(st.booleans()),
                "messages": any_or(st.lists(message, max_size=2))}
    DETOKENIZE = {"tokens": any_or(ids), "skip_special_tokens": any_or(st.booleans())}
    ABORT = {"rid": any_or(texts), "abort_all": st.one_of(st.just(False), json_values)}

    return {"/generate": GENERATE, "/v1/completions": COMPLETION, "/v1/chat/completions": CHAT,
            "/tokenize": TOKENIZE, "/v1/tokenize": TOKENIZE, "/detokenize": DETOKENIZE, "/abort_request": ABORT,
            "_message": message}


BODIES = {True: _bodies(True), False: _bodies(False)}


GET_PATHS = ["/health", "/ready", "/model_info", "/get_model_info", "/server_info", "/v1/models",
             "/v1/models/x", "/metrics", "/openapi.json", "/flush_cache", "/nope", "/generate"]


@st.composite
def requests_(draw):
    """(method, path, body bytes or None, headers)."""
    if draw(st.integers(0, 9)) == 0:
        method = draw(st.sampled_from(["GET", "DELETE", "PATCH", "OPTIONS"]))
        return method, draw(st.sampled_from(GET_PATHS + [k for k in BODIES[True] if k.startswith("/")])), None, {}
    bodies = BODIES[draw(st.booleans())]
    path = draw(st.sampled_from(sorted(k for k in bodies if k.startswith("/"))))
    required = {"/v1/chat/completions": {"messages": st.lists(bodies["_message"], min_size=1, max_size=2)},
                "/v1/completions": {"prompt": texts}}.get(path, {})
    optional = {k: v for k, v in bodies[path].items() if k not in required}
    body = draw(st.fixed_dictionaries(required, optional=optional))
    if draw(st.integers(0, 19)) == 0:
        body["deep"] = deep(draw(st.sampled_from([10, 60, 70, 800])))
    raw = json.dumps(body if draw(st.integers(0, 19)) else draw(json_values), ensure_ascii=True).encode()
    headers = {"Content-Type": "application/json"}
    damage = draw(st.integers(0, 24))
    if damage == 0:
        raw = raw[:draw(st.integers(0, max(0, len(raw) - 1)))]
    elif damage == 1:
        raw = raw.replace(b'"', b"\xed\xa0\x80", 1)
    elif damage == 2:
        raw, headers["Content-Encoding"] = gzip.compress(raw), "gzip"
    elif damage == 3:
        headers["Content-Encoding"] = "gzip"  # but not gzip data
    elif damage == 4:
        headers["Content-Type"] = "text/plain"
    return "POST", path, raw, headers


def check_answer(resp) -> None:
    """The server's contract for any request: no 5xx (503 only when documented: loading or
    dead, which a healthy fuzzed server never is), errors in the JSON envelope, streams that
    end with [DONE] and whose error events are enveloped."""
    assert resp.status_code < 500, (resp.status_code, resp.text[:400])
    ctype = resp.headers.get("Content-Type", "")
    if resp.status_code >= 400:
        if resp.status_code == 401:
            return
        err = resp.json()["error"]
        assert isinstance(err["message"], str) and err["code"] in (resp.status_code, "model_not_found"), err
        return
    if ctype.startswith("text/event-stream"):
        lines = [ln for ln in resp.text.split("\n") if ln.startswith("data: ")]
        assert lines and lines[-1] == "data: [DONE]", resp.text[-300:]
        for ln in lines[:-1]:
            event = json.loads(ln[len("data: "):])
            if "error" in event:
                assert event["error"]["code"] < 500, event
