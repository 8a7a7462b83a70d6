"""The OpenAPI 3.1 document served at `/openapi.json`.

Built from the app's router, so every route appears; `ROUTE_DOCS` adds a summary, and
the request bodies are the very schemas the server checks requests with (schema.py,
built for this server's limits). A route missing from `ROUTE_DOCS` is still listed (and
the tests fail on it), so the document cannot silently fall behind the server.
"""

from __future__ import annotations

from typing import Any, Dict

# path -> (summary, whether its request body has a schema in schema.SCHEMAS)
ROUTE_DOCS: Dict[str, tuple] = {
    "/generate": ("Generate from text or token ids (single or batch; SSE when stream=true).", True),
    "/health": ("200 when the scheduler answers a 1-token probe, 503 otherwise.", False),
    "/health_generate": ("Same as /health.", False),
    "/ready": ("200 once the model is loaded and the scheduler is alive.", False),
    "/model_info": ("Model path, served name, architecture, context length, chat template.", False),
    "/get_model_info": ("Deprecated alias of /model_info.", False),
    "/server_info": ("Server arguments, scheduler limits and live internal state.", False),
    "/get_server_info": ("Deprecated alias of /server_info.", False),
    "/flush_cache": ("Clear the prefix cache (only when idle; 400 otherwise).", False),
    "/freeze_gc": ("Freeze the garbage collector's live objects in the scheduler and server processes "
                   "(later collections skip them).", False),
    "/get_load": ("Load per data-parallel replica: requests running and waiting, KV tokens in use.", False),
    "/abort_request": ("Abort requests whose id starts with rid, or all of them.", True),
    "/tokenize": ("Token ids of a prompt or chat messages.", True),
    "/v1/tokenize": ("Alias of /tokenize.", True),
    "/detokenize": ("Text of token ids.", True),
    "/v1/detokenize": ("Alias of /detokenize.", True),
    "/metrics": ("Prometheus metrics (sglang:* series).", False),
    "/openapi.json": ("This document.", False),
    "/v1/models": ("OpenAI: list the served model.", False),
    "/v1/models/{model}": ("OpenAI: one model card (404 for other names).", False),
    "/v1/completions": ("OpenAI text completions.", True),
    "/v1/chat/completions": ("OpenAI chat completions (the model's chat template).", True),
    "/v1/embeddings": ("OpenAI embeddings (pooled final hidden states, L2-normalized; float or base64).",
                       True),
    "/encode": ("SGLang's native embeddings of text or token ids (single or batch).", True),
    "/open_session": ("Open a session; answers its id. Requests continue in it with session_params.", True),
    "/close_session": ("Close a session (its requests can no longer be continued).", True),
    "/update_weights_from_disk": ("Load new weights in place (idle only); flushes the cache, bumps "
                                  "weight_version.", True),
    "/release_memory_occupation": ("Free the weights and KV tensors (idle only); generation answers "
                                   "503 until resumed.", True),
    "/resume_memory_occupation": ("Re-create what /release_memory_occupation freed.", True),
    "/get_weight_version": ("The weight version (meta_info.weight_version of new outputs).", False),
    "/inspect": ("The Inspector: a live page of the scheduler's state (radix tree, batch, KV pool, "
                 "grammars); open without the API key, it holds no data.", False),
    "/inspect/tree.js": ("The Inspector page's tree drawing script.", False),
    "/inspect/inspect.js": ("The Inspector page's script.", False),
    "/inspect/inspect.css": ("The Inspector page's style.", False),
    "/inspect/state": ("The Inspector's snapshot of the scheduler (JSON); query max_nodes in [1, 20000], "
                       "default 2000 radix tree nodes.", False),
    "/hicache/storage-backend": ("HiCache's L3 storage backend: PUT attaches, DELETE detaches (idle only; "
                                 "409 when busy), GET shows it.", True),
}
_ERROR = {"type": "object", "required": ["error"], "properties": {
    "error": {"type": "object", "required": ["message", "type", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"}, "param": {"type": ["string", "null"]},
        "code": {"type": "integer"}}},
    "status": {"type": "string", "enum": ["loading", "restarting", "dead"]}, "progress": {"type": "object"}}}
_ERRORS = {
    "400": "Bad request: the message names the field, what was expected and what came",
    "404": "No such route or model", "405": "Method not allowed", "413": "Body over --max-request-bytes",
    "503": "Loading (status: loading, with progress), or the scheduler is not running "
           "(status: restarting or dead)",
}


def build_openapi(app, version: str) -> Dict[str, Any]:
    from lmprog_runtime.server.http import RUNTIME

    schemas = app[RUNTIME].schemas
    paths: Dict[str, Dict[str, Any]] = {}
    for route in app.router.routes():
        info = route.resource.get_info() if route.resource is not None else {}
        path = info.get("path") or info.get("formatter")
        if not path or route.method == "HEAD":
            continue
        summary, has_body = ROUTE_DOCS.get(path, ("(undocumented)", False))
        error = {"content": {"application/json": {"schema": _ERROR}}}
        op: Dict[str, Any] = {"summary": summary, "responses": {
            "200": {"description": "OK"},
            **{code: {"description": text, **error} for code, text in _ERRORS.items()}}}
        if has_body and path in schemas and route.method in ("POST", "PUT"):
            op["requestBody"] = {"required": True,
                                 "content": {"application/json": {"schema": schemas[path]}}}
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
