"""The aiohttp app: SGLang's native routes, auth and error envelopes, SSE streaming.

Every handler talks to the runtime only through `ServerRuntime` (its TokenizerManager,
model info and metrics). Errors a client caused are HTTP 400 with
`{"error": {"message": ...}}`; the server stays up whatever the body holds.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from contextlib import aclosing
from typing import Any, AsyncIterator, Optional

from aiohttp import web, web_protocol

from lmprog_runtime.config import HEALTH_CHECK_TIMEOUT_S
from lmprog_runtime.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from lmprog_runtime.server.data_parallel import per_replica
from lmprog_runtime.server.metrics import HEALTH_CHECK_PREFIX
from lmprog_runtime.server.limits import check_fanout, check_output_room, check_prompt_size
from lmprog_runtime.server.validate import SchemaError, decompress, parse_body, validate
from lmprog_runtime.generate_request import RequestError

logger = logging.getLogger(__name__)

RUNTIME = web.AppKey("runtime", object)
OPEN_PREFIXES = ("/health", "/ready", "/metrics")  # never behind --api-key
# the Inspector's page files: no data in them (its /inspect/state is behind the key)
OPEN_PATHS = ("/inspect", "/inspect/tree.js", "/inspect/inspect.js", "/inspect/inspect.css")
PROBE_PATHS = ("/health", "/health_generate", "/ready")  # answer while loading / dead
INLINE_BODY_BYTES = 256 * 1024  # smaller bodies are parsed and checked on the event loop
FLUSH_OK = ("Cache flushed.\nPlease check backend logs for more details. (When there are running or "
            "waiting requests, the operation will not be performed.)\n")


# -- envelopes and body parsing -----------------------------------------------------------------
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                405: "method_not_allowed", 413: "request_too_large", 415: "unsupported_media_type",
                503: "service_unavailable"}


def error_type(status: int) -> str:
    return _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")


def error_body(message: str, status: int, err_type: Optional[str] = None, param: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": err_type or error_type(status), "param": param,
                      "code": status}}


def error_response(message: str, status: int = 400, err_type: Optional[str] = None,
                   param: Optional[str] = None, headers=None, extra: Optional[dict] = None) -> web.Response:
    """The JSON error envelope; `extra` adds top-level keys (e.g. the loading progress)."""
    body = {**error_body(message, status, err_type, param), **(extra or {})}
    keep = {k: v for k, v in (headers or {}).items() if k.lower() in ("allow", "retry-after")}
    return web.json_response(body, status=status, headers=keep)


async def read_request(request: web.Request, endpoint: str) -> dict:
    """The body of `request`, decoded and checked against the schema of `endpoint`."""
    rt = request.app[RUNTIME]
    raw = await request.read()  # aiohttp enforces --max-request-bytes (413)
    if len(raw) < INLINE_BODY_BYTES:
        return _decode_and_check(rt, raw, request.headers.get("Content-Encoding", ""), endpoint)
    return await asyncio.get_running_loop().run_in_executor(  # big bodies: off the event loop
        None, _decode_and_check, rt, raw, request.headers.get("Content-Encoding", ""), endpoint)


def _decode_and_check(rt, raw: bytes, encoding: str, endpoint: str) -> dict:
    raw = decompress(raw, encoding, rt.args.max_request_bytes)
    obj = parse_body(raw, rt.args.max_json_depth)
    validate(obj, rt.schemas[endpoint])
    return obj


def sse_line(obj: Any) -> bytes:
    # backslashreplace: a lone surrogate becomes its JSON escape instead of breaking the stream
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode("utf-8", "backslashreplace") + b"\n\n"


def _retyped(chunk: Any) -> Any:
    """An error event of the stream, typed by its status code (503 is not a client error)."""
    if isinstance(chunk, dict) and isinstance(chunk.get("error"), dict):
        err = chunk["error"]
        code = err.get("code") if isinstance(err.get("code"), int) else 500
        return {"error": {**error_body(err.get("message", ""), code)["error"], "retryable": code == 503}}
    return chunk


async def write_sse(request: web.Request, chunks: AsyncIterator[Any]) -> web.StreamResponse:
    """Stream `chunks` as SSE, then `data: [DONE]`. A client that goes away closes the
    iterator, which aborts its requests in the scheduler. Any failure after the headers
    went out is sent as an error event, never as a silently closed connection."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    async with aclosing(chunks):
        try:
            async for chunk in chunks:
                await resp.write(sse_line(_retyped(chunk)))
        except RequestError as e:
            await resp.write(sse_line({"error": {**error_body(str(e), e.status)["error"],
                                                 "retryable": e.status == 503}}))
        except (ConnectionResetError, ConnectionError):
            logger.info("client disconnected mid-stream; aborting its request(s)")
            return resp
        except Exception as e:  # noqa: BLE001 - the stream must end with an event
            logger.exception("error inside a stream of %s", request.path)
            await resp.write(sse_line(error_body(f"Internal server error: {type(e).__name__}: {e}", 500)))
    try:
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
    except ConnectionError:
        pass
    return resp


async def control(rt, kind: str, timeout: float = 30.0, msg=None):
    """A control round trip to the scheduler; 503 at once when it is not running."""
    if rt.dead:
        raise RequestError(f"The scheduler is not running: {rt.dead}", 503)
    try:
        return await rt.tm.control(kind, timeout, msg)
    except asyncio.TimeoutError:
        raise RequestError(f"The scheduler did not answer {kind!r} within {timeout:.0f}s.", 503) from None


async def off_loop(rt, fn, *args):
    """Run `fn(*args)` (tokenizing, chat templates) on the tokenizer thread, not the event loop."""
    return await asyncio.get_running_loop().run_in_executor(rt.tokenize_pool, fn, *args)


# -- middleware ---------------------------------------------------------------------------------
@web.middleware
async def auth_middleware(request: web.Request, handler):
    key = request.app[RUNTIME].args.api_key
    path = request.path
    if key and request.method != "OPTIONS" and not path.startswith(OPEN_PREFIXES) and path not in OPEN_PATHS:
        if request.headers.get("Authorization", "") != f"Bearer {key}":
            return error_response("Incorrect API key provided: send 'Authorization: Bearer <--api-key>'.",
                                  401)
    return await handler(request)


@web.middleware
async def state_middleware(request: web.Request, handler):
    """While the model loads, or after the scheduler died, every route but the probes is a 503."""
    rt = request.app[RUNTIME]
    if rt.dead and request.path not in PROBE_PATHS:
        return error_response(rt.unavailable_message(), 503, extra=rt.state_fields())
    return await handler(request)


@web.middleware
async def error_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except SchemaError as e:
        return error_response(str(e), e.status, param=e.path)
    except RequestError as e:
        return error_response(str(e), e.status)
    except web.HTTPException as e:
        if e.status >= 400 and e.content_type != "application/json":
            message = e.text if e.text and not e.text.startswith(str(e.status)) else e.reason
            return error_response(message, e.status, headers=e.headers)
        raise
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as e:
        logger.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(f"Internal server error: {type(e).__name__}: {e}", 500)


# -- native routes ----------------------------------------------------------------------------
async def generate(request: web.Request) -> web.StreamResponse:
    rt = request.app[RUNTIME]
    obj = await read_request(request, "/generate")
    _check_per_item(obj)
    check_prompt_size(rt, obj.get("text"))
    sampling = obj.get("sampling_params")
    dicts = [d or {} for d in (sampling if isinstance(sampling, list) else [sampling])]
    clamp = [bool(d.pop("clamp_max_new_tokens", False)) for d in dicts]  # boundary-only flag
    explicit = [d.get("max_new_tokens") is not None for d in dicts]
    check_fanout(rt, _prompt_count(obj), max(d.get("n") or 1 for d in dicts), "sampling_params.n")
    job = await off_loop(rt, rt.tm.parse, obj)
    check_output_room(rt, job, explicit, clamp, "sampling_params.max_new_tokens",
                      "sampling_params.clamp_max_new_tokens")
    if job.stream:
        return await write_sse(request, rt.tm.generate_stream(obj, job))
    return web.json_response(await rt.tm.generate(obj, job))


def _prompt_count(obj: dict) -> int:
    text, ids = obj.get("text"), obj.get("input_ids")
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        return len(ids)
    return len(text) if isinstance(text, list) else 1


_PER_ITEM = ("return_logprob", "logprob_start_len", "top_logprobs_num", "cache_salt", "extra_key",
             "bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key")


def _check_per_item(obj: dict) -> None:
    """Lists of per-prompt values belong to batches only (the scheduler hashes cache_salt)."""
    text, ids = obj.get("text"), obj.get("input_ids")
    if isinstance(text, list) or (isinstance(ids, list) and ids and isinstance(ids[0], list)):
        tids, count = obj.get("token_ids_logprob"), _prompt_count(obj)
        if tids and isinstance(tids[0], list) and len(tids) != count:
            raise SchemaError("token_ids_logprob", f"one list per prompt ({count})", None, f"{len(tids)} lists")
        return
    for key in _PER_ITEM:
        if isinstance(obj.get(key), list):
            raise SchemaError(key, "a single value for a single prompt (lists give one value per prompt "
                                   "of a batch)", obj[key])


async def health(request: web.Request) -> web.Response:
    rt = request.app[RUNTIME]
    if rt.dead:
        return error_response(rt.unavailable_message(), 503, extra=rt.state_fields())
    busy = any(not rid.startswith(HEALTH_CHECK_PREFIX) for rid in rt.tm.states)
    if busy and time.monotonic() - rt.last_output_time < 1.0:
        return web.Response(text="")  # the scheduler is visibly making progress
    probe = {"input_ids": [0], "sampling_params": {"max_new_tokens": 1, "temperature": 0},
             "rid": f"{HEALTH_CHECK_PREFIX}_{uuid.uuid4().hex}"}
    try:
        await asyncio.wait_for(rt.tm.generate(probe), HEALTH_CHECK_TIMEOUT_S)
    except asyncio.TimeoutError:
        return error_response("unhealthy: the scheduler did not answer in time", 503)
    except RequestError as e:
        return error_response(f"unhealthy: {e}", 503)
    return web.Response(text="")


async def ready(request: web.Request) -> web.Response:
    rt = request.app[RUNTIME]
    if rt.dead:
        return error_response(rt.unavailable_message(), 503, extra=rt.state_fields())
    return web.Response(text="")


async def get_model_info(request: web.Request) -> web.Response:
    rt = request.app[RUNTIME]
    return web.json_response({**rt.model_info, "weight_version": rt.tm.weight_version})


async def get_server_info(request: web.Request) -> web.Response:
    rt = request.app[RUNTIME]
    info = rt.server_info()
    reply = await control(rt, "internal_state")
    info["internal_states"] = per_replica(reply)  # one dict per DP rank, as SGLang's
    info["version"] = _version()
    return web.json_response(info)


async def flush_cache(request: web.Request) -> web.Response:
    reply = await control(request.app[RUNTIME], "flush_cache")
    if reply.success:
        return web.Response(text=FLUSH_OK)
    return error_response(reply.message, 400)


async def freeze_gc(request: web.Request) -> web.Response:
    """Collect, then freeze the live objects of every scheduler process and of this one
    (gc_tuning.py): later garbage collections skip them."""
    from lmprog_runtime import gc_tuning

    reply = await control(request.app[RUNTIME], "freeze_gc")
    if not reply.success:
        return error_response(reply.message, 500)
    gc_tuning.freeze()
    return web.Response(text="Garbage collection frozen.")


async def abort_request(request: web.Request) -> web.Response:
    obj = await read_request(request, "/abort_request")
    rid, abort_all = obj.get("rid") or "", bool(obj.get("abort_all"))
    if rid or abort_all:
        request.app[RUNTIME].tm.abort(rid, abort_all)
    return web.Response(text="")


async def tokenize(request: web.Request) -> web.Response:
    from lmprog_runtime.server.openai_api import render_chat

    rt = request.app[RUNTIME]
    obj = await read_request(request, "/tokenize")
    add_special = obj.get("add_special_tokens") is not False
    limits = {"max_model_len": rt.tm.context_len}
    if obj.get("messages") is not None:
        tokens = await off_loop(rt, render_chat, rt, obj["messages"], obj)
        return web.json_response({"tokens": tokens, "count": len(tokens), **limits})
    prompt = obj.get("prompt")
    if prompt is None:
        raise SchemaError("prompt", "a string or a non-empty list of strings (or give messages)", None, "nothing")
    check_prompt_size(rt, prompt, "prompt")
    texts = [prompt] if isinstance(prompt, str) else prompt
    tokens = await off_loop(rt, lambda: [rt.tokenizer.encode(t, add_special_tokens=add_special) for t in texts])
    if isinstance(prompt, str):
        return web.json_response({"tokens": tokens[0], "count": len(tokens[0]), **limits})
    return web.json_response({"tokens": tokens, "count": [len(t) for t in tokens], **limits})


async def detokenize(request: web.Request) -> web.Response:
    rt = request.app[RUNTIME]
    obj = await read_request(request, "/detokenize")
    skip = obj.get("skip_special_tokens") is not False
    text = await off_loop(rt, lambda: rt.tokenizer.decode(obj["tokens"], skip_special_tokens=skip))
    return web.json_response({"text": text})


async def metrics(request: web.Request) -> web.Response:
    rt = request.app[RUNTIME]
    if not rt.args.enable_metrics:
        raise web.HTTPNotFound(reason="Metrics are disabled.")
    states = [rt.tm.scheduler_stats or {}]
    if not rt.dead:
        try:
            states = per_replica(await control(rt, "internal_state", timeout=2.0))
        except RequestError:
            pass
    body = rt.metrics.render(states[0] if rt.args.dp_size == 1 else states)
    return web.Response(body=body, headers={"Content-Type": METRICS_CONTENT_TYPE})


async def get_load(request: web.Request) -> web.Response:
    """SGLang's /get_load: one entry per DP rank (requests running, waiting, KV tokens in use)."""
    rt = request.app[RUNTIME]
    reply = await control(rt, "internal_state", timeout=5.0)
    loads = [{"dp_rank": s.get("dp_rank", r), "num_reqs": s.get("num_running_reqs", 0) + s.get("num_queue_reqs", 0),
              "num_waiting_reqs": s.get("num_queue_reqs", 0), "num_tokens": s.get("num_used_tokens", 0),
              **rt.dispatcher.load(s.get("dp_rank", r))}
             for r, s in enumerate(per_replica(reply))]
    return web.json_response(loads)


async def openapi_json(request: web.Request) -> web.Response:
    from lmprog_runtime.server.openapi import build_openapi

    return web.json_response(build_openapi(request.app, _version()))


NATIVE_ROUTES = [
    ("POST", "/generate", generate), ("PUT", "/generate", generate),
    ("GET", "/health", health), ("GET", "/health_generate", health), ("GET", "/ready", ready),
    ("GET", "/model_info", get_model_info), ("GET", "/get_model_info", get_model_info),
    ("GET", "/server_info", get_server_info), ("GET", "/get_server_info", get_server_info),
    ("GET", "/flush_cache", flush_cache), ("POST", "/flush_cache", flush_cache),
    ("POST", "/freeze_gc", freeze_gc),
    ("POST", "/abort_request", abort_request),
    ("POST", "/tokenize", tokenize), ("POST", "/v1/tokenize", tokenize),
    ("POST", "/detokenize", detokenize), ("POST", "/v1/detokenize", detokenize),
    ("GET", "/metrics", metrics), ("GET", "/openapi.json", openapi_json),
    ("GET", "/get_load", get_load),
]


def create_app(runtime) -> web.Application:
    from lmprog_runtime.server.admin_api import ADMIN_ROUTES
    from lmprog_runtime.server.chat_api import CHAT_ROUTES
    from lmprog_runtime.server.embeddings_api import EMBEDDING_ROUTES
    from lmprog_runtime.server.inspect_api import INSPECT_ROUTES
    from lmprog_runtime.server.openai_api import OPENAI_ROUTES

    app = web.Application(middlewares=[error_middleware, auth_middleware, state_middleware],
                          client_max_size=runtime.args.max_request_bytes)
    app[RUNTIME] = runtime
    inspector = [] if runtime.args.disable_inspector else INSPECT_ROUTES
    routes = NATIVE_ROUTES + OPENAI_ROUTES + CHAT_ROUTES + EMBEDDING_ROUTES + ADMIN_ROUTES + inspector
    for method, path, handler in routes:
        app.router.add_route(method, path, handler)
    return app


class _EnvelopeHandler(web_protocol.RequestHandler):
    """aiohttp's connection handler, answering protocol errors (bad request line, unknown
    method, oversized headers) with the JSON envelope instead of plain text."""

    def handle_error(self, request, status: int = 500, exc=None, message=None) -> web.StreamResponse:
        plain = super().handle_error(request, status, exc, message)  # logs; raises if already sent
        text = message or (str(exc) if exc is not None else plain.reason)
        resp = error_response(text, status)
        resp.force_close()
        return resp


class _EnvelopeServer(web.Server):
    def __call__(self) -> web_protocol.RequestHandler:
        return _EnvelopeHandler(self, loop=self._loop, **self._kwargs)


class EnvelopeAppRunner(web.AppRunner):
    """AppRunner whose connections use `_EnvelopeHandler`; bodies are not auto-decompressed
    (read_request decodes them with a size bound and a 400 for bad data)."""

    def __init__(self, app: web.Application, **kwargs):
        super().__init__(app, auto_decompress=False, **kwargs)

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _EnvelopeServer  # same state, our handler factory
        return server


def _version() -> str:
    from lmprog_runtime import __version__

    return __version__
