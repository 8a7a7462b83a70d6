"""The KV manager of one scheduler and its per-request senders (prefill) and receivers (decode).

Control messages (`base.TransferInfo`, `TransferAbort`, `TransferDone`) travel over ZMQ:
each manager binds one PULL socket (its control endpoint) that a listener thread drains into
per-room mailboxes; the scheduler thread sends through PUSH sockets it alone uses. A prefill
manager registers that endpoint with its bootstrap server (PUT /route); a decode receiver
looks it up there (GET /route, on a worker thread) and probes the bootstrap server's /health
every DISAGGREGATION_HEARTBEAT_INTERVAL_S: after DISAGGREGATION_HEARTBEAT_MAX_FAILURE misses in
a row, every room of that prefill server fails.

KV bytes go through the transfer backend (transfer.py), written synchronously by the
scheduler thread: a source slot is read before the step that could free it.
"""

from __future__ import annotations

import logging
import pickle
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Dict, List, Optional, Tuple

import zmq

from lmprog_runtime import config
from lmprog_runtime.disaggregation.base import (BaseKVManager, BaseKVReceiver, BaseKVSender, KVPoll,
                                                PoolLayout, TransferAbort, TransferDone, TransferInfo)
from lmprog_runtime.disaggregation.bootstrap import KVBootstrapServer, http_json, lookup_rank

logger = logging.getLogger(__name__)

LISTEN_POLL_MS = 50
STALE_ROOM_S = 600.0  # a mailbox entry nobody claimed is dropped after this long


def pool_layout(pool, page_size: int) -> PoolLayout:
    """`pool`: a TokenToKVPool; k/v are [layers, rows, kv_heads, head_dim], contiguous."""
    k, v = pool.k, pool.v
    assert k.is_contiguous() and v.is_contiguous()
    return PoolLayout(k_ptr=k.data_ptr(), v_ptr=v.data_ptr(), rows=k.shape[1], num_layers=k.shape[0],
                      slot_bytes=k.shape[2] * k.shape[3] * k.element_size(), page_size=page_size,
                      dtype=str(k.dtype).removeprefix("torch."))


def kv_bytes_per_token(layout: PoolLayout) -> int:
    """K and V of one position over every layer: what one token costs on the wire."""
    return 2 * layout.num_layers * layout.slot_bytes


def handoff(room: int, rid: str, direction: str, peer: str, state: KVPoll, tokens, bytes_per_token: int,
            bytes_done, since: float) -> dict:
    """One transfer as the Inspector shows it (scheduler/inspect.py HANDOFF_FIELDS)."""
    return {"id": room, "rid": rid, "direction": direction, "peer": peer, "state": state.name,
            "bytes": None if tokens is None else tokens * bytes_per_token, "bytes_done": bytes_done,
            "elapsed_s": time.monotonic() - since}


def slot_runs(src: List[int], dst: List[int]) -> List[Tuple[int, int, int]]:
    """Maximal runs (src_start, dst_start, length) where both slot lists count up by one."""
    runs = []
    i = 0
    while i < len(src):
        j = i + 1
        while j < len(src) and src[j] == src[j - 1] + 1 and dst[j] == dst[j - 1] + 1:
            j += 1
        runs.append((src[i], dst[i], j - i))
        i = j
    return runs


class KVManager(BaseKVManager):
    def __init__(self, args, pool, page_size: int, transfer):
        self.mode = args.disaggregation_mode
        self.host = args.host
        self.transfer = transfer
        self._pool, self._page_size = pool, page_size
        self._registered = set()  # (ptr, nbytes) given to the transfer backend
        self.page_size = self.layout.page_size  # reading the layout registers the pool's memory
        self._ctx = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        port = self._pull.bind_to_random_port(f"tcp://{self.host}")
        self.endpoint = f"tcp://{self.host}:{port}"
        self._push: Dict[str, zmq.Socket] = {}
        self._lock = threading.Lock()
        self.mail: Dict[int, Tuple[float, object]] = {}  # room → (arrival, TransferInfo | Abort | Done)
        self._acked: Dict[int, float] = {}  # rooms whose abort this (prefill) side answered
        self.ended: Dict[int, Tuple[float, str]] = {}  # prefill: rooms that ended before their handshake
        self.arrived = threading.Event()  # set on every control message (wakes an idle loop)
        self._stop = threading.Event()
        self._listener = threading.Thread(target=self._listen, name="lmprog-kv-listen", daemon=True)
        self._listener.start()
        self.bootstrap_server: Optional[KVBootstrapServer] = None
        self._routes: Dict[str, Future] = {}  # bootstrap addr → Future[(ip, port)]
        self._lookups = ThreadPoolExecutor(2, thread_name_prefix="lmprog-kv-route")
        self.dead: Dict[str, Tuple[float, str]] = {}  # bootstrap addr → (since, why it is considered gone)
        self._misses: Dict[str, int] = {}
        self._heartbeat: Optional[threading.Thread] = None
        if self.mode == "prefill":
            self._serve_bootstrap(args)
        else:
            self._heartbeat = threading.Thread(target=self._probe, name="lmprog-kv-heartbeat", daemon=True)
            self._heartbeat.start()

    @property
    def layout(self) -> PoolLayout:
        """The pool as it is now (its tensors are re-created after a memory release), its
        memory registered with the transfer backend."""
        if self._pool.k is None:
            raise RuntimeError("the KV pool is released (/release_memory_occupation); resume it first")
        lay = pool_layout(self._pool, self._page_size)
        nbytes = lay.num_layers * lay.rows * lay.slot_bytes
        for ptr in (lay.k_ptr, lay.v_ptr):
            if (ptr, nbytes) not in self._registered:
                self.transfer.register(ptr, nbytes)
                self._registered.add((ptr, nbytes))
        return lay

    # -- prefill: the bootstrap server and this rank's registration -------------------------
    def _serve_bootstrap(self, args) -> None:
        self.bootstrap_server = KVBootstrapServer(args.host, args.disaggregation_bootstrap_port)
        self.bootstrap_server.start()
        body = {"attn_tp_size": 1, "attn_tp_rank": 0, "attn_cp_size": 1, "attn_cp_rank": 0,
                "attn_dp_size": 1, "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0, "system_dp_size": 1,
                "system_dp_rank": 0, "rank_ip": self.host, "rank_port": int(self.endpoint.rsplit(":", 1)[1]),
                "page_size": self.layout.page_size, "kv_cache_dtype": self.layout.dtype,
                "prefill_http_port": args.port, "load_balance_method": "follow_bootstrap_room"}
        status, answer = http_json("PUT", f"http://{args.host}:{args.disaggregation_bootstrap_port}/route", body)
        if status != 200:
            raise RuntimeError(f"registering with the bootstrap server failed: {status} {answer}")

    # -- the wire -----------------------------------------------------------------------------
    def _listen(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(LISTEN_POLL_MS):
                continue
            try:
                msg = pickle.loads(self._pull.recv(zmq.NOBLOCK))
            except (zmq.ZMQError, pickle.PickleError, EOFError, AttributeError) as e:
                logger.warning("dropped a bad KV control message: %s", e)
                continue
            with self._lock:
                self._post(msg)
            self.arrived.set()

    def _post(self, msg) -> None:
        now = time.monotonic()
        old = self.mail.get(msg.room)
        if isinstance(msg, TransferInfo) and old is not None and isinstance(old[1], TransferAbort):
            return  # the decode half already gave up on this room
        self.mail[msg.room] = (now, msg)
        for room in [r for r, (t, _) in self.mail.items() if now - t > STALE_ROOM_S]:
            del self.mail[room]

    def peek(self, room: int):
        with self._lock:
            entry = self.mail.get(room)
        return None if entry is None else entry[1]

    def take(self, room: int) -> None:
        with self._lock:
            self.mail.pop(room, None)

    def answer_aborts(self) -> None:
        """Prefill side, scheduler thread: every abort received is answered with a failed
        TransferDone (the decode side then frees the room's slots: nothing writes them any more,
        since writes happen on this thread). The abort stays, so a late request fails."""
        with self._lock:
            todo = [(r, m) for r, (_, m) in self.mail.items() if isinstance(m, TransferAbort) and r not in self._acked]
            late = [(r, m) for r, (_, m) in self.mail.items() if isinstance(m, TransferInfo) and r in self.ended]
        now = time.monotonic()
        for room, msg in todo:
            self._acked[room] = now
            if msg.endpoint:
                self.push(msg.endpoint, TransferDone(room, False, message=f"aborted: {msg.message}"))
        for room, info in late:  # the prefill half ended first: its decode half fails at once
            self.take(room)
            self.push(info.endpoint, TransferDone(room, False, message=self.ended.pop(room)[1]))
        for table in (self._acked, self.ended):
            for room in [r for r, v in table.items() if now - (v if isinstance(v, float) else v[0]) > STALE_ROOM_S]:
                del table[room]

    def push(self, endpoint: str, msg) -> bool:
        """Send `msg` to a peer's control endpoint without blocking; False if it cannot go."""
        sock = self._push.get(endpoint)
        if sock is None:
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 1024)
            sock.connect(endpoint)
            self._push[endpoint] = sock
        try:
            sock.send(pickle.dumps(msg), zmq.NOBLOCK)
            return True
        except zmq.ZMQError as e:
            logger.warning("KV control message to %s not sent: %s", endpoint, e)
            return False

    # -- decode: routes and liveness ------------------------------------------------------------
    def route(self, addr: str) -> Future:
        fut = self._routes.get(addr)
        if fut is None or (fut.done() and fut.exception() is not None):
            fut = self._routes[addr] = self._lookups.submit(self._lookup, addr)
        return fut

    @staticmethod
    def _lookup(addr: str) -> Tuple[str, int]:
        deadline = time.monotonic() + config.DISAGGREGATION_BOOTSTRAP_TIMEOUT_S
        while True:  # 503 while the prefill ranks register; an unreachable server fails at once
            try:
                return lookup_rank(addr)
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def gone_since(self, addr: str, t: float) -> Optional[str]:
        """Why `addr`'s prefill server is gone, if it was declared gone after time `t`."""
        entry = self.dead.get(addr)
        return entry[1] if entry is not None and entry[0] >= t else None

    def _probe(self) -> None:
        while not self._stop.wait(config.DISAGGREGATION_HEARTBEAT_INTERVAL_S):
            for addr in list(self._routes):
                try:
                    ok = http_json("GET", f"http://{addr}/health", timeout=2.0)[0] == 200
                except OSError:
                    ok = False
                self._misses[addr] = 0 if ok else self._misses.get(addr, 0) + 1
                if not ok and self._misses[addr] >= config.DISAGGREGATION_HEARTBEAT_MAX_FAILURE:
                    why = f"the prefill server's bootstrap server {addr} stopped answering"
                    self.dead[addr] = (time.monotonic(), why)
                    self._routes.pop(addr, None)  # a later request looks it up afresh

    # -- roles --------------------------------------------------------------------------------
    def sender(self, bootstrap, prompt_len: int) -> "KVSender":
        return KVSender(self, bootstrap.room, prompt_len)

    def receiver(self, bootstrap) -> "KVReceiver":
        return KVReceiver(self, bootstrap)

    def close(self) -> None:
        self._stop.set()
        self._listener.join(2)
        if self._heartbeat is not None:
            self._heartbeat.join(2)
        self._lookups.shutdown(wait=False, cancel_futures=True)
        if self.bootstrap_server is not None:
            self.bootstrap_server.close()
        for sock in self._push.values():
            sock.close(0)
        self._pull.close(0)
        self._ctx.term()


class KVSender(BaseKVSender):
    """The prefill half of one room."""

    def __init__(self, manager: KVManager, room: int, prompt_len: int):
        self.m, self.room, self.prompt_len = manager, room, prompt_len
        self.created = time.monotonic()
        self.info: Optional[TransferInfo] = None
        self.state = KVPoll.Bootstrapping
        self.failure = ""
        self.bytes_sent = 0
        self.transfer_s = 0.0

    def poll(self) -> KVPoll:
        if self.state in (KVPoll.Failed, KVPoll.Success):
            return self.state
        msg = self.m.peek(self.room)
        if isinstance(msg, TransferAbort):
            return self._fail(f"the decode server ended room {self.room}: {msg.message}")
        if self.info is None and isinstance(msg, TransferInfo):
            why = self.m.layout.compatible(msg.layout)
            theirs = msg.decode_prefix_len + len(msg.dst_slots)
            if why is None and theirs != self.prompt_len:
                why = (f"the prompt is {theirs} tokens on the decode server and {self.prompt_len} here "
                       f"(different tokenizers or chat templates?)")
            if why is not None:
                self.info = msg  # so that abort() tells the decode side
                return self._fail(why)
            self.info, self.state = msg, KVPoll.WaitingForInput
        if self.info is None and time.monotonic() - self.created > config.DISAGGREGATION_BOOTSTRAP_TIMEOUT_S:
            return self._fail(f"no decode server bootstrapped room {self.room} within "
                              f"{config.DISAGGREGATION_BOOTSTRAP_TIMEOUT_S:g} s")
        return self.state

    def _fail(self, why: str) -> KVPoll:
        self.state, self.failure = KVPoll.Failed, why
        return self.state

    def send(self, src_slots: List[int], start: int) -> None:
        info = self.info
        skip = max(info.decode_prefix_len - start, 0)  # positions the decode cache already holds
        src = src_slots[skip:]
        first = start + skip - info.decode_prefix_len
        dst = info.dst_slots[first:first + len(src)]
        if len(dst) != len(src):
            raise RuntimeError(f"room {self.room}: {len(src)} pages to send but the decode side "
                               f"gave slots for {len(dst)}")
        t0 = time.perf_counter()
        mine, theirs = self.m.layout, info.layout
        srcs, dsts, lens = [], [], []
        for s, d, n in slot_runs(src, dst):
            for layer in range(mine.num_layers):
                for base, peer in ((mine.k_ptr, theirs.k_ptr), (mine.v_ptr, theirs.v_ptr)):
                    srcs.append(base + (layer * mine.rows + s) * mine.slot_bytes)
                    dsts.append(peer + (layer * theirs.rows + d) * theirs.slot_bytes)
                    lens.append(n * mine.slot_bytes)
        moved = self.m.transfer.write(info.session_id, srcs, dsts, lens)
        self.state = KVPoll.Transferring
        self.bytes_sent += moved
        self.transfer_s += time.perf_counter() - t0

    def finish(self, meta: dict) -> None:
        done = TransferDone(self.room, True, meta=meta, bytes_sent=self.bytes_sent, transfer_s=self.transfer_s)
        if not self.m.push(self.info.endpoint, done):
            raise RuntimeError(f"room {self.room}: the decode server's endpoint {self.info.endpoint} "
                               f"refused the metadata")
        self.m.take(self.room)
        self.state = KVPoll.Success

    def abort(self, message: str) -> None:
        """End this half: the decode side learns it (a failed TransferDone, which also tells it
        nothing writes its slots any more), now if its endpoint is known (from the handshake or
        its own abort), else when its handshake comes."""
        if self.state is not KVPoll.Success:
            mail = self.m.peek(self.room)
            endpoint = self.info.endpoint if self.info is not None else getattr(mail, "endpoint", "")
            if endpoint:
                self.m.push(endpoint, TransferDone(self.room, False, message=message))
            else:
                self.m.ended[self.room] = (time.monotonic(), message)
            self._fail(message)
        self.m.take(self.room)


class KVReceiver(BaseKVReceiver):
    """The decode half of one room."""

    def __init__(self, manager: KVManager, bootstrap):
        self.m, self.room, self.addr = manager, bootstrap.room, bootstrap.addr
        self.route = manager.route(self.addr)
        self.created = time.monotonic()
        self.state = KVPoll.Bootstrapping
        self.failure = ""
        self.sent_at = 0.0
        self.tokens = 0
        self.done: Optional[TransferDone] = None

    def poll(self) -> KVPoll:
        if self.state in (KVPoll.Failed, KVPoll.Success):
            return self.state
        gone = self.m.gone_since(self.addr, self.created)
        if gone is not None:
            return self._fail(gone)
        if self.state is KVPoll.Bootstrapping and self.route.done():
            exc = self.route.exception()
            if exc is not None:
                return self._fail(f"the bootstrap server {self.addr} is not reachable: {type(exc).__name__}: {exc}")
            self.state = KVPoll.WaitingForInput
        if self.state is KVPoll.Transferring:
            msg = self.m.peek(self.room)
            if isinstance(msg, TransferDone):
                self.m.take(self.room)
                self.done = msg
                if not msg.ok:
                    return self._fail(f"the prefill server failed room {self.room}: {msg.message}")
                self.state = KVPoll.Success
            elif time.monotonic() - self.sent_at > config.DISAGGREGATION_WAITING_TIMEOUT_S:
                self.abort("timed out")
                return self._fail(f"the KV of room {self.room} did not arrive within "
                                  f"{config.DISAGGREGATION_WAITING_TIMEOUT_S:g} s")
        return self.state

    def _fail(self, why: str) -> KVPoll:
        self.state, self.failure = KVPoll.Failed, why
        return self.state

    def _prefill_endpoint(self) -> str:
        ip, port = self.route.result()
        return f"tcp://{ip}:{port}"

    def send_metadata(self, dst_slots: List[int], decode_prefix_len: int) -> None:
        self.tokens = len(dst_slots)  # positions the prefill side will write (the Inspector's size)
        info = TransferInfo(self.room, self.m.endpoint, self.m.transfer.session_id, self.m.layout,
                            dst_slots, decode_prefix_len)
        if not self.m.push(self._prefill_endpoint(), info):
            self._fail(f"the prefill server of room {self.room} does not take the handshake")
            return
        self.sent_at = time.monotonic()
        self.state = KVPoll.Transferring

    def abort(self, message: str) -> None:
        if self.route.done() and self.route.exception() is None:
            self.m.push(self._prefill_endpoint(), TransferAbort(self.room, message, self.m.endpoint))
        self.m.take(self.room)
        if self.state is not KVPoll.Success:
            self._fail(message)
