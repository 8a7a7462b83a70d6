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

from aiohttp import web

from lmprog_runtime.config import HEALTH_CHECK_TIMEOUT_S
from lmprog_runtime.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from lmprog_runtime.server.metrics import HEALTH_CHECK_PREFIX
from lmprog_runtime.tokenizer_manager import RequestError

logger = logging.getLogger(__name__)

RUNTIME = web.AppKey("runtime", object)
OPEN_PREFIXES = ("/health", "/ready", "/metrics")  # never behind --api-key
FLUSH_OK = ("Cache flushed.\nPlease check backend logs for more details. (When there are running or "
            "waiting requests, the operation will not be performed.)\n")


# -- envelopes and body parsing -----------------------------------------------------------------
def error_response(message: str, status: int = 400, err_type: Optional[str] = None) -> web.Response:
    err_type = err_type or ("invalid_request_error" if status < 500 else "server_error")
    body = {"error": {"message": message, "type": err_type, "param": None, "code": status}}
    return web.json_response(body, status=status)


async def read_json(request: web.Request, kind: type = dict) -> Any:
    """The request body as JSON of type `kind`, or RequestError(400) naming the problem."""
    raw = await request.read()
    if not raw.strip():
        raise RequestError("The request body is empty; expected a JSON object.")
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RequestError(f"Malformed JSON in the request body: {e}") from None
    if not isinstance(obj, kind):
        raise RequestError(f"The request body must be a JSON object, got {type(obj).__name__}.")
    return obj


def sse_line(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


async def write_sse(request: web.Request, chunks: AsyncIterator[Any]) -> web.StreamResponse:
    """Stream `chunks` as SSE, then `data: [DONE]`. A client that goes away closes the
    iterator, which aborts its requests in the scheduler."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    async with aclosing(chunks):
        try:
            async for chunk in chunks:
                await resp.write(sse_line(chunk))
        except RequestError as e:
            await resp.write(sse_line({"error": {"message": str(e), "type": "invalid_request_error",
                                                 "code": e.status, "retryable": False}}))
        except ConnectionResetError:
            logger.info("client disconnected mid-stream; aborting its request(s)")
            return resp
    try:
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
    except ConnectionResetError:
        pass
    return resp


async def control(rt, kind: str, timeout: float = 30.0):
    """A control round trip to the scheduler; 503 at once when it is not running."""
    if rt.dead:
        raise RequestError(f"The scheduler is not running: {rt.dead}", 503)
    try:
        return await rt.tm.control(kind, timeout)
    except asyncio.TimeoutError:
        raise RequestError(f"The scheduler did not answer {kind!r} within {timeout:.0f}s.", 503) from None


# -- middleware ---------------------------------------------------------------------------------
@web.middleware
async def auth_middleware(request: web.Request, handler):
    key = request.app[RUNTIME].args.api_key
    if key and request.method != "OPTIONS" and not request.path.startswith(OPEN_PREFIXES):
        if request.headers.get("Authorization", "") != f"Bearer {key}":
            return web.json_response({"error": "Unauthorized"}, status=401)
    return await handler(request)


@web.middleware
async def error_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except RequestError as e:
        return error_response(str(e), e.status)
    except web.HTTPException as e:
        if e.status >= 400 and e.content_type != "application/json":
            return error_response(e.reason, e.status, err_type=e.reason.replace(" ", ""))
        raise
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as e:
        logger.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(f"Internal server error: {type(e).__name__}: {e}", 500)


# -- native routes ----------------------------------------------------------------------------
async def generate(request: web.Request) -> web.StreamResponse:
    rt = request.app[RUNTIME]
    obj = await read_json(request)
    job = rt.tm.parse(obj)
    if job.stream:
        return await write_sse(request, rt.tm.generate_stream(obj, job))
    return web.json_response(await rt.tm.generate(obj, job))


async def health(request: web.Request) -> web.Response:
    rt = request.app[RUNTIME]
    if rt.dead:
        return web.Response(status=503, text=f"unhealthy: {rt.dead}\n")
    busy = any(not rid.startswith(HEALTH_CHECK_PREFIX) for rid in rt.tm.states)
    if busy and time.monotonic() - rt.last_output_time < 1.0:
        return web.Response(text="")  # the scheduler is visibly making progress
    probe = {"input_ids": [0], "sampling_params": {"max_new_tokens": 1, "temperature": 0},
             "rid": f"{HEALTH_CHECK_PREFIX}_{uuid.uuid4().hex}"}
    try:
        await asyncio.wait_for(rt.tm.generate(probe), HEALTH_CHECK_TIMEOUT_S)
    except asyncio.TimeoutError:
        return web.Response(status=503, text="unhealthy: the scheduler did not answer in time\n")
    except RequestError as e:
        return web.Response(status=503, text=f"unhealthy: {e}\n")
    return web.Response(text="")


async def ready(request: web.Request) -> web.Response:
    rt = request.app[RUNTIME]
    return web.Response(status=503 if rt.dead else 200, text="")


async def get_model_info(request: web.Request) -> web.Response:
    return web.json_response(request.app[RUNTIME].model_info)


async def get_server_info(request: web.Request) -> web.Response:
    rt = request.app[RUNTIME]
    info = rt.server_info()
    reply = await control(rt, "internal_state")
    info["internal_states"] = [reply.data]
    info["version"] = _version()
    return web.json_response(info)


async def flush_cache(request: web.Request) -> web.Response:
    reply = await control(request.app[RUNTIME], "flush_cache")
    if reply.success:
        return web.Response(text=FLUSH_OK)
    return web.Response(status=400, text=reply.message)


async def abort_request(request: web.Request) -> web.Response:
    obj = await read_json(request)
    rid, abort_all = obj.get("rid", ""), obj.get("abort_all", False)
    if rid is None:
        rid = ""
    if not isinstance(rid, str):
        raise RequestError(f"rid must be a string, got {type(rid).__name__}.")
    if not isinstance(abort_all, bool):
        raise RequestError(f"abort_all must be a boolean, got {type(abort_all).__name__}.")
    if rid or abort_all:
        request.app[RUNTIME].tm.abort(rid, abort_all)
    return web.Response(text="")


async def tokenize(request: web.Request) -> web.Response:
    from lmprog_runtime.server.openai_api import render_chat

    rt = request.app[RUNTIME]
    obj = await read_json(request)
    add_special = obj.get("add_special_tokens", True)
    if not isinstance(add_special, bool):
        raise RequestError("add_special_tokens must be a boolean.")
    if "messages" in obj:
        tokens = render_chat(rt, obj["messages"], obj)
        return web.json_response({"tokens": tokens, "count": len(tokens), "max_model_len": rt.tm.context_len})
    prompt = obj.get("prompt")
    if isinstance(prompt, str):
        tokens = rt.tokenizer.encode(prompt, add_special_tokens=add_special)
        return web.json_response({"tokens": tokens, "count": len(tokens), "max_model_len": rt.tm.context_len})
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        tokens = [rt.tokenizer.encode(p, add_special_tokens=add_special) for p in prompt]
        return web.json_response({"tokens": tokens, "count": [len(t) for t in tokens],
                                  "max_model_len": rt.tm.context_len})
    raise RequestError("Provide prompt (a string or a non-empty list of strings) or messages.")


async def detokenize(request: web.Request) -> web.Response:
    rt = request.app[RUNTIME]
    obj = await read_json(request)
    tokens = obj.get("tokens")
    skip = obj.get("skip_special_tokens", True)
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise RequestError("tokens must be a list of integers.")
    bad = [t for t in tokens if not 0 <= t < rt.tm.vocab_size]
    if bad:
        raise RequestError(f"tokens contains out-of-vocabulary token id {bad[0]}; "
                           f"valid range is [0, {rt.tm.vocab_size}).")
    if not isinstance(skip, bool):
        raise RequestError("skip_special_tokens must be a boolean.")
    return web.json_response({"text": rt.tokenizer.decode(tokens, skip_special_tokens=skip)})


async def metrics(request: web.Request) -> web.Response:
    rt = request.app[RUNTIME]
    if not rt.args.enable_metrics:
        raise web.HTTPNotFound(reason="Metrics are disabled.")
    state = rt.tm.scheduler_stats
    if not rt.dead:
        try:
            state = (await control(rt, "internal_state", timeout=2.0)).data
        except RequestError:
            pass
    body = rt.metrics.render(state or {})
    return web.Response(body=body, headers={"Content-Type": METRICS_CONTENT_TYPE})


async def openapi_json(request: web.Request) -> web.Response:
    from lmprog_runtime.server.openapi import build_openapi

    return web.json_response(build_openapi(request.app, _version()))


NATIVE_ROUTES = [
    ("POST", "/generate", generate), ("PUT", "/generate", generate),
    ("GET", "/health", health), ("GET", "/health_generate", health), ("GET", "/ready", ready),
    ("GET", "/model_info", get_model_info), ("GET", "/get_model_info", get_model_info),
    ("GET", "/server_info", get_server_info), ("GET", "/get_server_info", get_server_info),
    ("GET", "/flush_cache", flush_cache), ("POST", "/flush_cache", flush_cache),
    ("POST", "/abort_request", abort_request),
    ("POST", "/tokenize", tokenize), ("POST", "/v1/tokenize", tokenize),
    ("POST", "/detokenize", detokenize), ("POST", "/v1/detokenize", detokenize),
    ("GET", "/metrics", metrics), ("GET", "/openapi.json", openapi_json),
]


def create_app(runtime) -> web.Application:
    from lmprog_runtime.server.openai_api import OPENAI_ROUTES

    app = web.Application(middlewares=[error_middleware, auth_middleware], client_max_size=64 * 1024 * 1024)
    app[RUNTIME] = runtime
    for method, path, handler in NATIVE_ROUTES + OPENAI_ROUTES:
        app.router.add_route(method, path, handler)
    return app


def _version() -> str:
    from lmprog_runtime import __version__

    return __version__
