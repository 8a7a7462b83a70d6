"""The OpenAPI 3.1 document served at `/openapi.json`.

Built from the app's router, so every route appears; `ROUTE_DOCS` adds a summary and
the request-body schema. A route missing from `ROUTE_DOCS` is still listed (and the
tests fail on it), so the document cannot silently fall behind the server.
"""

from __future__ import annotations

from typing import Any, Dict

_INT_LIST = {"type": "array", "items": {"type": "integer"}}
_SAMPLING = {
    "type": "object", "additionalProperties": False,
    "properties": {
        "max_new_tokens": {"type": "integer", "default": 128, "minimum": 0},
        "min_new_tokens": {"type": "integer", "default": 0},
        "temperature": {"type": "number", "default": 1.0, "minimum": 0},
        "top_p": {"type": "number", "default": 1.0}, "top_k": {"type": "integer", "default": -1},
        "min_p": {"type": "number", "default": 0.0},
        "frequency_penalty": {"type": "number", "default": 0.0},
        "presence_penalty": {"type": "number", "default": 0.0},
        "repetition_penalty": {"type": "number", "default": 1.0},
        "stop": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
        "stop_token_ids": _INT_LIST, "n": {"type": "integer", "default": 1},
        "json_schema": {"type": "string"}, "regex": {"type": "string"}, "ebnf": {"type": "string"},
        "ignore_eos": {"type": "boolean"}, "skip_special_tokens": {"type": "boolean"},
        "no_stop_trim": {"type": "boolean"}, "logit_bias": {"type": "object"},
        "sampling_seed": {"type": "integer"},
    },
}
_GENERATE = {
    "type": "object",
    "properties": {
        "text": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
        "input_ids": {"oneOf": [_INT_LIST, {"type": "array", "items": _INT_LIST}]},
        "sampling_params": {"oneOf": [_SAMPLING, {"type": "array", "items": _SAMPLING}]},
        "rid": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
        "stream": {"type": "boolean", "default": False},
        "return_logprob": {"type": "boolean"}, "logprob_start_len": {"type": "integer"},
        "top_logprobs_num": {"type": "integer"}, "token_ids_logprob": _INT_LIST,
        "return_text_in_logprobs": {"type": "boolean"}, "cache_salt": {"type": "string"},
        "extra_key": {"type": "string"}, "return_prompt_token_ids": {"type": "boolean"},
    },
}
_OPENAI_COMMON = {
    "model": {"type": "string"}, "n": {"type": "integer", "minimum": 1}, "stream": {"type": "boolean"},
    "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
    "temperature": {"type": "number"}, "top_p": {"type": "number"}, "top_k": {"type": "integer"},
    "max_tokens": {"type": "integer", "minimum": 1}, "seed": {"type": "integer"},
    "stop": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
    "frequency_penalty": {"type": "number"}, "presence_penalty": {"type": "number"},
    "logit_bias": {"type": "object"}, "response_format": {"type": "object"}, "rid": {"type": "string"},
    "cache_salt": {"type": "string"},
}
_COMPLETION = {"type": "object", "required": ["prompt"], "properties": {
    **_OPENAI_COMMON, "prompt": {"oneOf": [{"type": "string"}, {"type": "array"}]},
    "logprobs": {"type": "integer"}, "echo": {"type": "boolean"}}}
_CHAT = {"type": "object", "required": ["messages"], "properties": {
    **_OPENAI_COMMON, "messages": {"type": "array", "items": {"type": "object", "properties": {
        "role": {"type": "string"}, "content": {"oneOf": [{"type": "string"}, {"type": "array"}]}}}},
    "max_completion_tokens": {"type": "integer"}, "logprobs": {"type": "boolean"},
    "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20}}}
_TOKENIZE = {"type": "object", "properties": {
    "prompt": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
    "messages": {"type": "array"}, "add_special_tokens": {"type": "boolean", "default": True}}}
_DETOKENIZE = {"type": "object", "required": ["tokens"], "properties": {
    "tokens": _INT_LIST, "skip_special_tokens": {"type": "boolean", "default": True}}}
_ABORT = {"type": "object", "properties": {"rid": {"type": "string"}, "abort_all": {"type": "boolean"}}}

# path -> (summary, request body schema or None)
ROUTE_DOCS: Dict[str, tuple] = {
    "/generate": ("Generate from text or token ids (single or batch; SSE when stream=true).", _GENERATE),
    "/health": ("200 when the scheduler answers a 1-token probe, 503 otherwise.", None),
    "/health_generate": ("Same as /health.", None),
    "/ready": ("200 once the model is loaded and the scheduler is alive.", None),
    "/model_info": ("Model path, served name, architecture, context length, chat template.", None),
    "/get_model_info": ("Deprecated alias of /model_info.", None),
    "/server_info": ("Server arguments, scheduler limits and live internal state.", None),
    "/get_server_info": ("Deprecated alias of /server_info.", None),
    "/flush_cache": ("Clear the prefix cache (only when idle; 400 otherwise).", None),
    "/abort_request": ("Abort requests whose id starts with rid, or all of them.", _ABORT),
    "/tokenize": ("Token ids of a prompt or chat messages.", _TOKENIZE),
    "/v1/tokenize": ("Alias of /tokenize.", _TOKENIZE),
    "/detokenize": ("Text of token ids.", _DETOKENIZE),
    "/v1/detokenize": ("Alias of /detokenize.", _DETOKENIZE),
    "/metrics": ("Prometheus metrics (sglang:* series).", None),
    "/openapi.json": ("This document.", None),
    "/v1/models": ("OpenAI: list the served model.", None),
    "/v1/models/{model}": ("OpenAI: one model card (404 for other names).", None),
    "/v1/completions": ("OpenAI text completions.", _COMPLETION),
    "/v1/chat/completions": ("OpenAI chat completions (the model's chat template).", _CHAT),
}
_ERROR = {"type": "object", "properties": {"error": {"type": "object", "properties": {
    "message": {"type": "string"}, "type": {"type": "string"}, "code": {"type": "integer"}}}}}


def build_openapi(app, version: str) -> Dict[str, Any]:
    paths: Dict[str, Dict[str, Any]] = {}
    for route in app.router.routes():
        info = route.resource.get_info() if route.resource is not None else {}
        path = info.get("path") or info.get("formatter")
        if not path or route.method == "HEAD":
            continue
        summary, body = ROUTE_DOCS.get(path, ("(undocumented)", None))
        op: Dict[str, Any] = {"summary": summary, "responses": {
            "200": {"description": "OK"},
            "400": {"description": "Bad request", "content": {"application/json": {"schema": _ERROR}}}}}
        if body is not None and route.method in ("POST", "PUT"):
            op["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
        if "{model}" in path:
            op["parameters"] = [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}]
        paths.setdefault(path, {})[route.method.lower()] = op
    return {
        "openapi": "3.1.0",
        "info": {"title": "lmprog runtime", "version": version,
                 "description": "SGLang-compatible native API and OpenAI-compatible API."},
        "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{"bearer": []}],
        "paths": paths,
    }
