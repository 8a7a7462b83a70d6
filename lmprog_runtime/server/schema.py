"""One request schema per endpoint: the single table that both checks requests
(`validate.validate`) and documents them (`openapi.build_openapi`).

The schemas depend on the server's limits (vocabulary, `--max-n`, `--max-batch-size`, ...),
so they are built once per server from `Limits` by `request_schemas(limits)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Dict

from lmprog_runtime.sampling_params import MIN_REPETITION_PENALTY
from lmprog_runtime.server.metrics import HEALTH_CHECK_PREFIX

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
LOGIT_BIAS_BOUND = 100.0  # OpenAI documents logit_bias values in [-100, 100]
MAX_STOP_STRINGS = 32     # same bound as SamplingParams
MAX_STOP_BYTES = 256      # per stop string / stop_regex pattern
MAX_TOP_LOGPROBS = 20
MAX_MESSAGES = 4096
MAX_RID_CHARS = 256


@dataclass(frozen=True)
class Limits:
    """What one server accepts; every field has a flag in ServerArgs (or comes from the model)."""

    vocab_size: int = 1 << 30
    max_n: int = 64
    max_batch_size: int = 256          # prompts per request, and prompts x n
    max_logit_bias: int = 1024         # entries
    max_grammar_bytes: int = 65536     # regex / JSON schema / EBNF text
    max_stop_strings: int = MAX_STOP_STRINGS

    @classmethod
    def of(cls, args, vocab_size: int) -> "Limits":
        return cls(vocab_size=vocab_size, max_n=args.max_n, max_batch_size=args.max_batch_size,
                   max_logit_bias=args.max_logit_bias, max_grammar_bytes=args.max_grammar_bytes)


def _string(max_len: int = None, **kw) -> dict:
    out = {"type": "string", **kw}
    if max_len is not None:
        out["maxLength"] = max_len
    return out


_BOOL = {"type": "boolean"}
_OBJECT = {"type": "object"}
_INT64 = {"type": "integer", "minimum": INT64_MIN, "maximum": INT64_MAX}
_RID = _string(MAX_RID_CHARS, pattern=f"^(?!{HEALTH_CHECK_PREFIX})",
               description=f"a string of at most {MAX_RID_CHARS} characters not starting with "
                           f"{HEALTH_CHECK_PREFIX!r} (reserved for health probes)")


def _one_or_list(item: dict, max_items: int) -> dict:
    return {"anyOf": [item, {"type": "array", "items": item, "minItems": 1, "maxItems": max_items}]}


def _token_id(lim: Limits) -> dict:
    return {"type": "integer", "minimum": 0, "maximum": lim.vocab_size - 1,
            "description": f"a token id in [0, {lim.vocab_size - 1}] (the vocabulary)"}


def _token_ids(lim: Limits, min_items: int = 0) -> dict:
    return {"type": "array", "items": _token_id(lim), "minItems": min_items}


def _stops(lim: Limits, **kw) -> dict:
    return _one_or_list(_string(MAX_STOP_BYTES, **kw), lim.max_stop_strings)


def _logit_bias(lim: Limits) -> dict:
    return {"type": "object", "maxProperties": lim.max_logit_bias,
            "propertyNames": {"type": "string", "pattern": r"^[0-9]{1,10}$",
                              "description": "a token id written as a decimal string (a key)"},
            "additionalProperties": {"type": "number", "minimum": -LOGIT_BIAS_BOUND,
                                     "maximum": LOGIT_BIAS_BOUND}}


def _sampling_numbers() -> Dict[str, dict]:
    """The numeric sampling knobs shared by every endpoint (SGLang's ranges)."""
    return {
        "temperature": {"type": "number", "minimum": 0},
        "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "top_k": {"type": "integer", "minimum": -1, "maximum": INT64_MAX},
        "min_p": {"type": "number", "minimum": 0, "maximum": 1},
        "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
        "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
        "repetition_penalty": {"type": "number", "minimum": MIN_REPETITION_PENALTY, "maximum": 2},
    }


def sampling_schema(lim: Limits) -> dict:
    """`/generate`'s `sampling_params` (unknown keys are an error, as in SGLang)."""
    grammar = _string(lim.max_grammar_bytes)
    return {"type": "object", "additionalProperties": False, "properties": {
        "max_new_tokens": {"type": "integer", "minimum": 0, "maximum": INT64_MAX},
        "min_new_tokens": {"type": "integer", "minimum": 0, "maximum": INT64_MAX},
        "clamp_max_new_tokens": {**_BOOL, "x-note": "cut max_new_tokens to what the server can "
                                                     "hold instead of answering 400"},
        "stop": _stops(lim), "stop_regex": _stops(lim, format="regex"),
        "stop_token_ids": {**_token_ids(lim), "maxItems": 1024},
        **_sampling_numbers(),
        "n": {"type": "integer", "minimum": 1, "maximum": lim.max_n},
        "json_schema": {"anyOf": [grammar, _OBJECT]}, "regex": {**grammar, "format": "regex"}, "ebnf": grammar,
        "structural_tag": grammar,
        "ignore_eos": _BOOL, "skip_special_tokens": _BOOL, "spaces_between_special_tokens": _BOOL,
        "no_stop_trim": _BOOL,
        "stream_interval": {"type": "integer", "minimum": 1, "maximum": 1 << 20},
        "logit_bias": _logit_bias(lim), "sampling_seed": _INT64, "seed": _INT64,
        "custom_params": _OBJECT,
    }}


_IGNORED_GENERATE = ("lora_path", "priority", "custom_labels", "no_logs", "modalities",
                     "return_hidden_states", "background", "conversation_id",
                     "model")  # sglang-router adds the worker's model id to every /generate
# SGLang output options this server does not have: sglang-router sends them as false on every
# /generate, so false is accepted and true is a 400 naming the field.
_FALSE_ONLY_GENERATE = ("return_bytes", "return_entropy")
# SGLang fields for features this server does not have yet: a request that sets one is a 400
# naming it (accepting and ignoring them would silently do something else than asked).
_DATA_PARALLEL = ("choosing the replica is not supported yet (--dp-size balances with "
                  "--load-balance-method)")
UNSUPPORTED_FIELDS = {"data_parallel_rank": _DATA_PARALLEL, "routed_dp_rank": _DATA_PARALLEL}
MAX_HOSTNAME_CHARS = 255


def bootstrap_fields(per_item) -> Dict[str, dict]:
    """Prefill/decode disaggregation (SGLang's fields, set by the router on both servers):
    the prefill server's bootstrap address and the room that pairs the two halves of a
    request. `per_item` wraps a field that a batch may give per prompt."""
    return {
        "bootstrap_host": per_item(_string(MAX_HOSTNAME_CHARS, minLength=1,
                                           description="the prefill server's host name or address")),
        "bootstrap_port": per_item({"type": "integer", "minimum": 1, "maximum": 65535,
                                    "description": "the prefill server's --disaggregation-bootstrap-port"}),
        "bootstrap_room": per_item({"type": "integer", "minimum": 0, "maximum": INT64_MAX,
                                    "description": "an integer in [0, 2^63-1] pairing the prefill and "
                                                   "decode halves (a batch's scalar room is room + i)"}),
        "bootstrap_pair_key": per_item(_string(MAX_RID_CHARS)),
    }


def _unsupported() -> Dict[str, dict]:
    return {k: {"x-unsupported": why, "description": f"not supported yet: {why}"}
            for k, why in UNSUPPORTED_FIELDS.items()}


SESSION_PARAMS = {"type": "object", "additionalProperties": False, "required": ["id"], "properties": {
    "id": _string(MAX_RID_CHARS, description="an open session's id (from /open_session)"),
    "rid": _RID, "offset": {"type": "integer", "minimum": 0, "maximum": INT64_MAX},
    "replace": _BOOL, "drop_previous_output": _BOOL}}


def generate_schema(lim: Limits) -> dict:
    b = lim.max_batch_size
    ids = _token_ids(lim, 1)
    per_item = lambda item: _one_or_list(item, b)  # noqa: E731 - one value, or one per prompt
    props = {
        "text": _one_or_list(_string(), b),
        "input_ids": {"anyOf": [ids, {"type": "array", "items": ids, "minItems": 1, "maxItems": b}]},
        "sampling_params": per_item(sampling_schema(lim)),
        "rid": per_item(_RID), "stream": _BOOL,
        "return_logprob": per_item(_BOOL),
        "logprob_start_len": per_item({"type": "integer", "minimum": -1, "maximum": INT64_MAX}),
        "top_logprobs_num": per_item({"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS}),
        "token_ids_logprob": {"anyOf": [_token_ids(lim), {"type": "array", "items": _token_ids(lim),
                                                          "maxItems": b}]},
        "return_text_in_logprobs": _BOOL,
        "cache_salt": per_item(_string(MAX_RID_CHARS)), "extra_key": per_item(_string(MAX_RID_CHARS)),
        "return_prompt_token_ids": _BOOL, "log_metrics": _BOOL, "session_params": SESSION_PARAMS,
        **bootstrap_fields(per_item),
    }
    props.update({k: {"description": "accepted and ignored (SGLang compatibility)"} for k in _IGNORED_GENERATE})
    props.update(_unsupported())
    props.update({k: {"enum": [False], "description": "only false (sglang-router always sends it); not "
                                                      "supported yet"} for k in _FALSE_ONLY_GENERATE})
    return {"type": "object", "additionalProperties": False, "properties": props}


def _openai_common(lim: Limits) -> Dict[str, dict]:
    grammar = _string(lim.max_grammar_bytes)
    return {
        "model": _string(MAX_RID_CHARS), "n": {"type": "integer", "minimum": 1, "maximum": lim.max_n},
        "stream": _BOOL, "stream_options": {"type": "object", "properties": {"include_usage": _BOOL}},
        **_sampling_numbers(),
        "max_tokens": {"type": "integer", "minimum": 1, "maximum": INT64_MAX},
        "clamp_max_tokens": {**_BOOL, "x-note": "cut max_tokens to what the server can hold "
                                                 "instead of answering 400"},
        "seed": _INT64, "stop": _stops(lim), "stop_token_ids": {**_token_ids(lim), "maxItems": 1024},
        "ignore_eos": _BOOL, "skip_special_tokens": _BOOL, "no_stop_trim": _BOOL,
        "logit_bias": _logit_bias(lim),
        "min_tokens": {"type": "integer", "minimum": 0, "maximum": INT64_MAX},
        "regex": {**grammar, "format": "regex"}, "ebnf": grammar, "json_schema": {"anyOf": [grammar, _OBJECT]},
        "response_format": {"type": "object", "required": ["type"], "properties": {
            "type": {"type": "string", "enum": ["text", "json_object", "json_schema", "structural_tag"]},
            "json_schema": {"type": "object", "properties": {
                "name": _string(64), "description": _string(), "schema": _OBJECT,
                "strict": {**_BOOL, "x-note": "constrained output always follows the schema exactly"}}}}},
        "rid": _RID, "cache_salt": _string(MAX_RID_CHARS), "extra_key": _string(MAX_RID_CHARS),
        "user": _string(MAX_RID_CHARS, description="a string of at most 256 characters (an end-user id; "
                                                   "accepted, not used)"),
        **bootstrap_fields(lambda item: item),
        **_unsupported(),
    }


def completion_schema(lim: Limits) -> dict:
    b = lim.max_batch_size
    ids = _token_ids(lim, 1)
    prompt = {"anyOf": [_string(minLength=1),
                        {"type": "array", "items": _string(), "minItems": 1, "maxItems": b},
                        ids,
                        {"type": "array", "items": ids, "minItems": 1, "maxItems": b}]}
    return {"type": "object", "required": ["prompt"], "properties": {
        **_openai_common(lim), "prompt": prompt,
        "logprobs": {"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS},
        "echo": _BOOL, "suffix": _string(), "best_of": {"type": "integer", "minimum": 1, "maximum": 1}}}


_FUNCTION_NAME = _string(64, pattern=r"^[A-Za-z0-9_.-]{1,64}$",
                         description="a function name of 1 to 64 letters, digits, _ . or -")
TOOL = {"type": "object", "required": ["type", "function"], "properties": {
    "type": {"type": "string", "enum": ["function"]},
    "function": {"type": "object", "required": ["name"], "properties": {
        "name": _FUNCTION_NAME, "description": _string(), "parameters": _OBJECT, "strict": _BOOL}}}}
NAMED_TOOL_CHOICE = {"type": "object", "required": ["type", "function"], "properties": {
    "type": {"type": "string", "enum": ["function"]},
    "function": {"type": "object", "required": ["name"], "properties": {"name": _FUNCTION_NAME}}}}
_PART = {"type": "object", "required": ["type"], "properties": {
    "type": {"type": "string", "enum": ["text"]}, "text": _string()}}
_MESSAGE = {"type": "object", "required": ["role"], "properties": {
    "role": {"type": "string", "enum": ["system", "developer", "user", "assistant", "tool"]},
    "content": {"anyOf": [_string(), {"type": "array", "items": _PART}]},
    "name": _string(MAX_RID_CHARS), "tool_calls": {"type": "array"}, "tool_call_id": _string(MAX_RID_CHARS)}}


def chat_schema(lim: Limits) -> dict:
    return {"type": "object", "required": ["messages"], "properties": {
        **_openai_common(lim),
        "messages": {"type": "array", "items": _MESSAGE, "minItems": 1, "maxItems": MAX_MESSAGES},
        "max_completion_tokens": {"type": "integer", "minimum": 1, "maximum": INT64_MAX},
        "logprobs": _BOOL, "top_logprobs": {"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS},
        "tools": {"type": "array", "items": TOOL, "maxItems": 128},
        "tool_choice": {"anyOf": [{"type": "string", "enum": ["none", "auto", "required"]}, NAMED_TOOL_CHOICE]},
        "parallel_tool_calls": _BOOL,
        "continue_final_message": _BOOL, "chat_template_kwargs": _OBJECT,
        "input_ids": _token_ids(lim, 1)}}


def tokenize_schema(lim: Limits) -> dict:
    return {"type": "object", "properties": {
        "prompt": _one_or_list(_string(), lim.max_batch_size),
        "messages": {"type": "array", "items": _MESSAGE, "minItems": 1, "maxItems": MAX_MESSAGES},
        "add_special_tokens": _BOOL, "model": _string(MAX_RID_CHARS),
        "continue_final_message": _BOOL, "tools": {"type": "array", "items": TOOL, "maxItems": 128},
        "chat_template_kwargs": _OBJECT}}


def detokenize_schema(lim: Limits) -> dict:
    return {"type": "object", "required": ["tokens"], "properties": {
        "tokens": _token_ids(lim), "skip_special_tokens": _BOOL, "model": _string(MAX_RID_CHARS)}}


def abort_schema(lim: Limits) -> dict:
    return {"type": "object", "properties": {"rid": _string(MAX_RID_CHARS), "abort_all": _BOOL}}


def embeddings_schema(lim: Limits) -> dict:
    b, ids = lim.max_batch_size, _token_ids(lim, 1)
    text_or_ids = {"anyOf": [_string(minLength=1), {"type": "array", "items": _string(minLength=1),
                                                     "minItems": 1, "maxItems": b},
                             ids, {"type": "array", "items": ids, "minItems": 1, "maxItems": b}]}
    return {"type": "object", "required": ["input"], "properties": {
        "input": text_or_ids, "model": _string(MAX_RID_CHARS),
        "encoding_format": {"type": "string", "enum": ["float", "base64"]},
        "dimensions": {"x-unsupported": "the vectors have the model's hidden size"},
        "user": _string(MAX_RID_CHARS)}}


def encode_schema(lim: Limits) -> dict:
    b, ids = lim.max_batch_size, _token_ids(lim, 1)
    return {"type": "object", "additionalProperties": False, "properties": {
        "text": _one_or_list(_string(minLength=1), b),
        "input_ids": {"anyOf": [ids, {"type": "array", "items": ids, "minItems": 1, "maxItems": b}]},
        "rid": _RID}}


def open_session_schema(lim: Limits) -> dict:
    return {"type": "object", "additionalProperties": False, "properties": {
        "capacity_of_str_len": {"type": "integer", "minimum": 0, "maximum": INT64_MAX},
        "session_id": _string(MAX_RID_CHARS, minLength=1),
        "streaming": {"type": "boolean", "enum": [False],
                      "description": "false (streaming sessions are not supported yet)"},
        "timeout": {"x-unsupported": "sessions stay open until /close_session (no timeout yet)"}}}


def close_session_schema(lim: Limits) -> dict:
    return {"type": "object", "additionalProperties": False, "required": ["session_id"],
            "properties": {"session_id": _string(MAX_RID_CHARS, minLength=1)}}


def update_weights_schema(lim: Limits) -> dict:
    return {"type": "object", "additionalProperties": False, "required": ["model_path"], "properties": {
        "model_path": _string(4096, minLength=1),
        "load_format": {"type": "string", "enum": ["auto"]},
        "weight_version": _string(MAX_RID_CHARS, minLength=1),
        "flush_cache": {"type": "boolean", "enum": [True], "description": "true (the cache is always flushed)"},
        "abort_all_requests": _BOOL}}


def memory_schema(lim: Limits) -> dict:
    from lmprog_runtime.messages import MEMORY_TAGS

    return {"type": "object", "additionalProperties": False, "properties": {
        "tags": {"type": "array", "minItems": 1, "items": {"type": "string", "enum": list(MEMORY_TAGS)}}}}


def storage_backend_schema(lim: Limits) -> dict:
    from lmprog_runtime.config import HICACHE_PREFETCH_POLICIES, HICACHE_STORAGE_BACKENDS

    return {"type": "object", "additionalProperties": False, "required": ["hicache_storage_backend"],
            "properties": {
                "hicache_storage_backend": {"type": "string", "enum": list(HICACHE_STORAGE_BACKENDS)},
                "hicache_storage_backend_extra_config_json": _string(
                    65536, description="a JSON object, as --hicache-storage-backend-extra-config"),
                "hicache_storage_prefetch_policy": {"type": "string", "enum": list(HICACHE_PREFETCH_POLICIES)},
                "hicache_storage_dir": _string(4096, minLength=1,
                                               description="the file backend's directory (lmprog's own field)")}}


# endpoint path -> schema builder; aliases share their target's schema
SCHEMAS = {
    "/generate": generate_schema, "/v1/completions": completion_schema, "/v1/chat/completions": chat_schema,
    "/tokenize": tokenize_schema, "/v1/tokenize": tokenize_schema,
    "/detokenize": detokenize_schema, "/v1/detokenize": detokenize_schema,
    "/abort_request": abort_schema,
    "/v1/embeddings": embeddings_schema, "/encode": encode_schema,
    "/open_session": open_session_schema, "/close_session": close_session_schema,
    "/update_weights_from_disk": update_weights_schema,
    "/release_memory_occupation": memory_schema, "/resume_memory_occupation": memory_schema,
    "/hicache/storage-backend": storage_backend_schema,
}


@lru_cache(maxsize=8)
def request_schemas(lim: Limits) -> Dict[str, dict]:
    return {path: build(lim) for path, build in SCHEMAS.items()}
