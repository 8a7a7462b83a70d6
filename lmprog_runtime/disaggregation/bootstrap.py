"""The bootstrap server of a prefill server (SGLang's routes, on --disaggregation-bootstrap-port).

    PUT  /route   a prefill rank registers {rank_ip, rank_port, page_size, kv_cache_dtype, ...}
    GET  /route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1
                  the prefill layout (503 until every rank registered); with concrete ranks:
                  {rank_ip, rank_port} of that rank's KV control endpoint
    POST /register_dp_rank {bootstrap_room, dp_rank};  POST /query_dp_ranks {bootstrap_rooms}
    GET  /health  "OK"

It runs aiohttp on a thread of its own (its own event loop), bound to 127.0.0.1 unless told
otherwise, and holds only this registry: the KV itself never passes through it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import urllib.parse
import urllib.request
from typing import Dict, Optional, Tuple

from aiohttp import web

from lmprog_runtime.disaggregation.base import BaseKVBootstrapServer

logger = logging.getLogger(__name__)

REGISTER_FIELDS = ("attn_tp_size", "attn_tp_rank", "attn_cp_size", "attn_cp_rank", "attn_dp_size",
                   "attn_dp_rank", "pp_size", "pp_rank", "system_dp_size", "system_dp_rank",
                   "rank_ip", "rank_port", "page_size", "kv_cache_dtype", "prefill_http_port",
                   "load_balance_method")
RANK_KEYS = ("attn_dp_rank", "attn_cp_rank", "attn_tp_rank", "pp_rank")
QUERY_KEYS = ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank")


class KVBootstrapServer(BaseKVBootstrapServer):
    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.ranks: Dict[Tuple[int, int, int, int], dict] = {}  # (dp, cp, tp, pp) → registration
        self.layout: Optional[dict] = None  # sizes from the first registration
        self.dp_ranks: Dict[int, int] = {}  # bootstrap_room → prefill dp rank
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._runner: Optional[web.AppRunner] = None
        self._thread: Optional[threading.Thread] = None

    # -- routes -----------------------------------------------------------------------------
    def _app(self) -> web.Application:
        app = web.Application()
        app.router.add_put("/route", self._put_route)
        app.router.add_get("/route", self._get_route)
        app.router.add_post("/register_dp_rank", self._register_dp_rank)
        app.router.add_post("/query_dp_ranks", self._query_dp_ranks)
        app.router.add_get("/health", lambda _: web.Response(text="OK"))
        return app

    async def _put_route(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
            key = tuple(int(body.get(k, 0)) for k in RANK_KEYS)
            entry = {k: body[k] for k in REGISTER_FIELDS if k in body}
            entry["rank_ip"], entry["rank_port"] = str(body["rank_ip"]), int(body["rank_port"])
        except (ValueError, KeyError, TypeError) as e:
            return web.json_response({"error": f"bad registration: {type(e).__name__}: {e}"}, status=400)
        self.ranks[key] = entry
        if self.layout is None:
            self.layout = {"attn_tp_size": int(body.get("attn_tp_size", 1)),
                           "attn_cp_size": int(body.get("attn_cp_size", 1)),
                           "dp_size": int(body.get("attn_dp_size", 1)), "pp_size": int(body.get("pp_size", 1)),
                           "page_size": body.get("page_size"), "kv_cache_dtype": body.get("kv_cache_dtype"),
                           "follow_bootstrap_room": True, "prefill_http_port": body.get("prefill_http_port")}
        return web.Response(text="OK")

    def _registered_all(self) -> bool:
        lay = self.layout
        return lay is not None and len(self.ranks) >= (lay["attn_tp_size"] * lay["attn_cp_size"]
                                                       * lay["dp_size"] * lay["pp_size"])

    async def _get_route(self, request: web.Request) -> web.Response:
        try:
            q = [int(request.query.get(k, -1)) for k in QUERY_KEYS]
        except ValueError as e:
            return web.json_response({"error": f"bad query: {e}"}, status=400)
        if not self._registered_all():
            return web.json_response({"error": "prefill ranks are still registering"}, status=503)
        if all(v == -1 for v in q):
            return web.json_response(self.layout)
        entry = self.ranks.get(tuple(max(v, 0) for v in q))
        if entry is None:
            return web.json_response({"error": f"no prefill rank {q}"}, status=404)
        return web.json_response({"rank_ip": entry["rank_ip"], "rank_port": entry["rank_port"]})

    async def _register_dp_rank(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.dp_ranks[int(body["bootstrap_room"])] = int(body["dp_rank"])
        return web.Response(text="OK")

    async def _query_dp_ranks(self, request: web.Request) -> web.Response:
        rooms = (await request.json()).get("bootstrap_rooms", [])
        return web.json_response({str(r): self.dp_ranks.get(int(r), 0) for r in rooms})

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        """Serve on a thread; returns once bound (a taken port raises OSError here)."""
        started = threading.Event()
        error = []

        def run():
            self._loop = asyncio.new_event_loop()
            try:
                self._loop.run_until_complete(self._bind())
            except Exception as e:  # noqa: BLE001 - reported to start()'s caller
                error.append(e)
                started.set()
                return
            started.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name="lmprog-bootstrap", daemon=True)
        self._thread.start()
        started.wait()
        if error:
            raise OSError(f"the bootstrap server cannot listen on {self.host}:{self.port}: {error[0]}")
        logger.info("bootstrap server on http://%s:%d", self.host, self.port)

    async def _bind(self) -> None:
        self._runner = web.AppRunner(self._app(), access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()

    def close(self) -> None:
        if self._loop is None or self._thread is None:
            return
        fut = asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop)
        try:
            fut.result(5)
        except Exception:  # noqa: BLE001 - closing anyway
            logger.exception("closing the bootstrap server")
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._thread = None


# -- the client side (decode servers; the prefill manager registering itself) ---------------
def http_json(method: str, url: str, body: Optional[dict] = None, timeout: float = 5.0):
    """(status, parsed JSON or text) of one request; raises OSError when nobody answers."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def lookup_rank(bootstrap_addr: str, timeout: float = 5.0) -> Tuple[str, int]:
    """The KV control endpoint (ip, port) of prefill rank 0 behind `bootstrap_addr` (host:port);
    raises RuntimeError while the ranks are registering or on a bad answer."""
    base = f"http://{bootstrap_addr}/route?"
    status, layout = http_json("GET", base + urllib.parse.urlencode({k: -1 for k in QUERY_KEYS}), timeout=timeout)
    if status != 200:
        raise RuntimeError(f"bootstrap server {bootstrap_addr} answered {status}: {layout}")
    status, rank = http_json("GET", base + urllib.parse.urlencode({k: 0 for k in QUERY_KEYS}), timeout=timeout)
    if status != 200 or not isinstance(rank, dict):
        raise RuntimeError(f"bootstrap server {bootstrap_addr} answered {status}: {rank}")
    return rank["rank_ip"], int(rank["rank_port"])
