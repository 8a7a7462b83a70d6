"""The Inspector's routes (docs/inspector.md):

    GET /inspect                      the page (static files of this package, nothing fetched)
    GET /inspect/{tree,inspect}.js,   its scripts and style
        /inspect/inspect.css
    GET /inspect/state?max_nodes=N&tree=1   the scheduler's snapshot, JSON (N in [1, 20000],
                                      default 2000; tree=0 skips the radix tree walk)

The page files hold no data, so they load without the API key (a browser cannot send a
header on navigation); `/inspect/state` is behind `--api-key` like every data route, and
the page asks for the key when it gets a 401. `--disable-inspector` registers none of
these routes (404).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from aiohttp import web

from lmprog_runtime.messages import INSPECT_MAX_NODES_CAP, INSPECT_MAX_NODES_DEFAULT, InspectReq
from lmprog_runtime.server.http import RUNTIME, control, error_response
from lmprog_runtime.server.validate import SchemaError

STATIC_DIR = Path(__file__).parent / "inspect"
PAGE_FILES = {  # path -> (file in STATIC_DIR, content type)
    "/inspect": ("index.html", "text/html"),
    "/inspect/tree.js": ("tree.js", "application/javascript"),
    "/inspect/inspect.js": ("inspect.js", "application/javascript"),
    "/inspect/inspect.css": ("inspect.css", "text/css"),
}
STATE_QUERY = ("max_nodes", "tree", "dp_rank")
SNAPSHOT_TIMEOUT_S = 10.0
_files: dict = {}  # file name -> bytes, read once


def _read(name: str) -> bytes:
    body = _files.get(name)
    if body is None:
        body = _files[name] = (STATIC_DIR / name).read_bytes()
    return body


async def page(request: web.Request) -> web.Response:
    name, content_type = PAGE_FILES[request.path]
    return web.Response(body=_read(name), content_type=content_type, charset="utf-8",
                        headers={"Cache-Control": "no-cache"})


def parse_query(query) -> InspectReq:
    """The snapshot request of a query string; 400 naming the field for anything else."""
    for key in query:
        if key not in STATE_QUERY:
            raise SchemaError(key, f"one of the query parameters {list(STATE_QUERY)}", key,
                              f"an unknown parameter {key!r}")
    tree = query.get("tree", "1")
    if tree not in ("0", "1"):
        raise SchemaError("tree", "0 or 1", tree)
    return InspectReq(_max_nodes(query.get("max_nodes")), include_tree=tree == "1")


def _dp_rank(raw, dp_size: int) -> int:
    """Which data-parallel replica's snapshot to answer with (0 unless asked)."""
    if raw is None:
        return 0
    expected = f"an integer in [0, {dp_size - 1}] (the server runs {dp_size} replicas)"
    if not raw.isdigit() or int(raw) >= dp_size:
        raise SchemaError("dp_rank", expected, raw)
    return int(raw)


def one_replica(data: dict, rank: int) -> dict:
    """With --dp-size N every replica answers (merged into `dp_states`): keep replica `rank`'s."""
    states = data.get("dp_states")
    if not states:
        return {**data, "dp_rank": 0, "dp_size": 1}
    return {**states[rank], "dp_rank": rank, "dp_size": len(states)}


def _max_nodes(raw) -> int:
    if raw is None:
        return INSPECT_MAX_NODES_DEFAULT
    expected = f"an integer in [1, {INSPECT_MAX_NODES_CAP}]"
    if not raw.isdigit() or len(raw) > 6:
        raise SchemaError("max_nodes", expected, raw)
    value = int(raw)
    if not 1 <= value <= INSPECT_MAX_NODES_CAP:
        raise SchemaError("max_nodes", expected, value)
    return value


async def state(request: web.Request) -> web.Response:
    rt = request.app[RUNTIME]
    req = parse_query(request.query)
    rank = _dp_rank(request.query.get("dp_rank"), getattr(getattr(rt, "args", None), "dp_size", 1))
    reply = await control(rt, "inspect", SNAPSHOT_TIMEOUT_S, req)
    if not reply.success:
        return error_response(reply.message, 500)
    data = one_replica(reply.data, rank)
    # a 20,000-node snapshot is megabytes of JSON: encode it off the event loop
    body = await asyncio.get_running_loop().run_in_executor(None, json.dumps, data)
    return web.Response(text=body, content_type="application/json", headers={"Cache-Control": "no-store"})


INSPECT_ROUTES = [("GET", path, page) for path in PAGE_FILES] + [("GET", "/inspect/state", state)]
