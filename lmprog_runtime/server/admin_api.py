"""Sessions and the RL hooks (SGLang's routes of the same names).

    POST /open_session             {capacity_of_str_len, session_id?}  -> "<session id>"
    POST /close_session            {session_id}
    POST /update_weights_from_disk {model_path, weight_version?}       -> {success, message, ...}
    POST /release_memory_occupation, /resume_memory_occupation  {tags?: ["weights", "kv_cache"]}
    GET  /get_weight_version                                           -> {"weight_version": ...}
    PUT  /hicache/storage-backend  {hicache_storage_backend, hicache_storage_backend_extra_config_json?,
                                    hicache_storage_prefetch_policy?, hicache_storage_dir?}
    DELETE /hicache/storage-backend, GET /hicache/storage-backend      -> {hicache_storage_backend, ...}

Weight and memory operations run only while the scheduler is idle (400 naming why
otherwise); while memory is released, generation answers 503. Attaching or detaching
HiCache's storage backend also runs only while idle (409 otherwise; 400 when invalid).
"""

from __future__ import annotations

from aiohttp import web

from lmprog_runtime.messages import MEMORY_TAGS, HiCacheStorageReq, MemoryOccupationReq, UpdateWeightsReq
from lmprog_runtime.server.http import RUNTIME, control, error_response, read_request
from lmprog_runtime.sessions import SessionError
from lmprog_runtime.generate_request import RequestError

WEIGHT_TIMEOUT_S = 600.0  # loading a model from disk may take minutes
STORAGE_TIMEOUT_S = 120.0  # joining a remote store (Mooncake) may take a while


async def open_session(request: web.Request) -> web.Response:
    rt = request.app[RUNTIME]
    obj = await read_request(request, "/open_session")
    try:
        session_id = rt.tm.sessions.open(obj.get("capacity_of_str_len") or 0, obj.get("session_id"))
    except SessionError as e:
        raise RequestError(str(e)) from None
    return web.json_response(session_id)


async def close_session(request: web.Request) -> web.Response:
    rt = request.app[RUNTIME]
    obj = await read_request(request, "/close_session")
    try:
        rt.tm.sessions.close(obj["session_id"])
    except SessionError as e:
        raise RequestError(str(e)) from None
    return web.Response(text="")


async def update_weights_from_disk(request: web.Request) -> web.Response:
    rt = request.app[RUNTIME]
    obj = await read_request(request, "/update_weights_from_disk")
    if obj.get("abort_all_requests"):
        rt.tm.abort(abort_all=True)
    msg = UpdateWeightsReq(obj["model_path"], obj.get("weight_version"))
    return _reply(await _control(rt, msg, WEIGHT_TIMEOUT_S))


async def release_memory_occupation(request: web.Request) -> web.Response:
    return await _memory(request, "/release_memory_occupation", release=True)


async def resume_memory_occupation(request: web.Request) -> web.Response:
    return await _memory(request, "/resume_memory_occupation", release=False)


async def _memory(request: web.Request, endpoint: str, release: bool) -> web.Response:
    rt = request.app[RUNTIME]
    obj = await read_request(request, endpoint) if request.can_read_body else {}
    msg = MemoryOccupationReq(release, tuple(obj.get("tags") or MEMORY_TAGS))
    return _reply(await _control(rt, msg, WEIGHT_TIMEOUT_S))


async def get_weight_version(request: web.Request) -> web.Response:
    return web.json_response({"weight_version": request.app[RUNTIME].tm.weight_version})


async def attach_storage_backend(request: web.Request) -> web.Response:
    rt = request.app[RUNTIME]
    obj = await read_request(request, "/hicache/storage-backend")
    msg = HiCacheStorageReq("attach", obj["hicache_storage_backend"],
                            obj.get("hicache_storage_backend_extra_config_json"),
                            obj.get("hicache_storage_prefetch_policy"), obj.get("hicache_storage_dir"))
    return _reply(await _control(rt, msg, STORAGE_TIMEOUT_S))


async def detach_storage_backend(request: web.Request) -> web.Response:
    return _reply(await _control(request.app[RUNTIME], HiCacheStorageReq("detach"), STORAGE_TIMEOUT_S))


async def storage_backend_status(request: web.Request) -> web.Response:
    reply = await _control(request.app[RUNTIME], HiCacheStorageReq("status"), 30.0)
    return web.json_response(reply.data)


async def _control(rt, msg, timeout: float):
    return await control(rt, msg.kind, timeout, msg)


def _reply(reply) -> web.Response:
    """200 with the reply's data, or the error envelope with its `code` (400 by default)."""
    data = dict(reply.data)
    code = data.pop("code", 400)
    if reply.success:
        return web.json_response({"success": True, "message": reply.message, **data})
    return error_response(reply.message, code, extra={"success": False})


ADMIN_ROUTES = [
    ("POST", "/open_session", open_session), ("POST", "/close_session", close_session),
    ("POST", "/update_weights_from_disk", update_weights_from_disk),
    ("POST", "/release_memory_occupation", release_memory_occupation),
    ("POST", "/resume_memory_occupation", resume_memory_occupation),
    ("GET", "/get_weight_version", get_weight_version),
    ("PUT", "/hicache/storage-backend", attach_storage_backend),
    ("DELETE", "/hicache/storage-backend", detach_storage_backend),
    ("GET", "/hicache/storage-backend", storage_backend_status),
]
