"""The one IPC mechanism between the server process and the scheduler process.

Two pyzmq PUSH/PULL sockets over `ipc://` paths in a private temp folder, carrying
pickled objects from `messages.py`:

    server  --PUSH--> to_scheduler --PULL-->  scheduler
    server  <--PULL-- to_server    <--PUSH--  scheduler

The server binds both sockets (it outlives the child); the scheduler connects. The
scheduler side is synchronous (`recv(block)` / `send(obj)`, the signature of
`Scheduler.run_forever`); the server side sends synchronously from its event loop and
receives on an asyncio task. Nothing else in the runtime touches zmq but disaggregation/conn.py
(its own sockets between a prefill and a decode server, for their KV handshakes).
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, List, Optional

import zmq
import zmq.asyncio

from lmprog_runtime.messages import ShutdownReq

logger = logging.getLogger(__name__)

# While blocked waiting for work the scheduler wakes this often (ms) to check its parent.
_IDLE_POLL_MS = 500


@dataclass(frozen=True)
class IpcPaths:
    folder: str
    to_scheduler: str  # ipc:// endpoint the scheduler reads from
    to_server: str     # ipc:// endpoint the server reads from

    @classmethod
    def create(cls) -> "IpcPaths":
        folder = tempfile.mkdtemp(prefix="lmprog-ipc-")
        return cls(folder, f"ipc://{folder}/to_scheduler", f"ipc://{folder}/to_server")

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def _dumps(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


# -- scheduler side ---------------------------------------------------------------------------
class SchedulerChannel:
    """The scheduler's end: `recv(block)` returns pending messages (`None` = shut down)."""

    def __init__(self, paths: IpcPaths):
        self.ctx = zmq.Context(1)
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.connect(paths.to_scheduler)
        self.outbox = self.ctx.socket(zmq.PUSH)
        self.outbox.setsockopt(zmq.SNDHWM, 0)  # never drop or block on outputs
        self.outbox.setsockopt(zmq.LINGER, 2000)
        self.outbox.connect(paths.to_server)
        self.parent_pid = os.getppid()
        self.paths = paths
        self.orphaned = False  # the server died without shutting us down

    def recv(self, block: bool) -> List[Any]:
        msgs: List[Any] = []
        if block:
            while not self.inbox.poll(_IDLE_POLL_MS):
                if os.getppid() != self.parent_pid:  # orphaned: the server is gone
                    self.orphaned = True
                    return [None]
        while True:
            try:
                raw = self.inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                return msgs
            obj = pickle.loads(raw)
            msgs.append(None if isinstance(obj, ShutdownReq) else obj)
            if msgs[-1] is None:
                return msgs

    def send(self, obj: Any) -> None:
        self.outbox.send(_dumps(obj))

    def close(self, linger_ms: int = 2000) -> None:
        """`linger_ms`: how long unsent messages (say, a SchedulerFailed) may still go out."""
        self.ctx.destroy(linger=linger_ms)
        if self.orphaned:  # nobody else will remove the socket files
            self.paths.remove()


# -- server side ------------------------------------------------------------------------------
class ServerChannel:
    """The server's end: synchronous `send(obj)` and an asyncio `receive_loop(handler)`."""

    def __init__(self, paths: IpcPaths):
        self.paths = paths
        self.sync_ctx = zmq.Context(1)  # sends are synchronous and never block (NOBLOCK, no HWM)
        self.ctx = zmq.asyncio.Context(1)
        self.outbox = self.sync_ctx.socket(zmq.PUSH)
        self.outbox.setsockopt(zmq.SNDHWM, 0)
        self.outbox.setsockopt(zmq.LINGER, 0)
        self.outbox.bind(paths.to_scheduler)
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.bind(paths.to_server)

    def send(self, obj: Any) -> None:
        """Queue `obj` for the scheduler without blocking the event loop."""
        try:
            self.outbox.send(_dumps(obj), zmq.NOBLOCK)
        except zmq.Again:  # no scheduler connected (dead or not started): the watcher reports it
            logger.warning("dropped %s: no scheduler connected", type(obj).__name__)

    async def recv(self, timeout: Optional[float] = None) -> Any:
        """One message, or raise `asyncio.TimeoutError` after `timeout` seconds."""
        return pickle.loads(await asyncio.wait_for(self.inbox.recv(), timeout))

    async def receive_loop(self, handler: Callable[[Any], None]) -> None:
        """Feed every message to `handler` until cancelled."""
        while True:
            raw = await self.inbox.recv()
            try:
                handler(pickle.loads(raw))
            except Exception:  # an unreadable message; within a BatchOutput the handler
                logger.exception("error handling a scheduler message")  # fails outputs one by one

    def close(self) -> None:
        self.outbox.close(linger=0)
        self.inbox.close(linger=0)
        self.ctx.term()
        self.sync_ctx.term()
        self.paths.remove()
