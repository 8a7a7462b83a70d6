"""One scheduler child process of the server and its IPC channel.

    server process                                  scheduler process (spawned), rank r
    SchedulerReplica(r): channel, sentinel  <─ ipc ─>  build_scheduler(args).run_forever(...)

The server holds `--dp-size` of these (one by default). Each has its own IPC folder, so
replicas never share a socket; its receive loop tags every message with its rank, and its
process sentinel reports the child's exit. `stop()` asks the child to shut down, joins (then
terminates) it and removes the IPC files.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
import sys
import time
from typing import Any, Callable, Dict, Optional

from lmprog_runtime.config import ServerArgs
from lmprog_runtime.ipc import IpcPaths, SchedulerChannel, ServerChannel
from lmprog_runtime.messages import SchedulerFailed, SchedulerReady, ShutdownReq

logger = logging.getLogger("lmprog_runtime.server")

PROGRESS_EVERY_S = 5.0
SHUTDOWN_GRACE_S = 10.0


# -- the scheduler process --------------------------------------------------------------------
def run_scheduler_process(args: ServerArgs, paths: IpcPaths) -> None:
    """Entry point of the spawned child: load the model, report, run the batch loop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the group; the server stops us
    setup_logging(args.log_level)
    _thread_only_tqdm()
    channel = SchedulerChannel(paths)
    try:
        from lmprog_runtime.engine import build_scheduler, model_info

        scheduler = build_scheduler(args)
        runner = scheduler.runner
        info = {"model_info": model_info(args, runner), "context_len": scheduler.context_len,
                "limits": scheduler.limits,
                "vocab_size": runner.model_config.vocab_size, "pid": os.getpid(),
                "device": str(getattr(runner, "device", "")), "dtype": str(getattr(runner, "dtype", "")),
                **scheduler.internal_state()}
    except Exception as e:
        logger.exception("the scheduler failed to start")
        channel.send(SchedulerFailed(f"{type(e).__name__}: {e}"))
        channel.close()
        sys.exit(1)
    channel.send(SchedulerReady(info))
    try:
        scheduler.run_forever(channel.recv, channel.send)
    except Exception as e:
        logger.exception("the scheduler crashed")
        channel.send(SchedulerFailed(f"{type(e).__name__}: {e}"))
        channel.close()
        sys.exit(1)
    channel.close(linger_ms=0)  # asked to shut down: nobody waits for more outputs


def _thread_only_tqdm() -> None:
    """Progress bars in the child take a thread lock, not a multiprocessing semaphore that
    would outlive a killed child in the resource tracker."""
    try:
        import threading

        from tqdm import tqdm
        tqdm.set_lock(threading.RLock())
    except ImportError:
        pass


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="[%(asctime)s %(processName)s] %(levelname)s %(message)s",
                        datefmt="%H:%M:%S")


# -- the server's handle on one scheduler ------------------------------------------------------
class SchedulerReplica:
    def __init__(self, args: ServerArgs, rank: int, progress: Callable[[str], None]):
        self.args = args  # this replica's (its share of the threads)
        self.rank = rank
        self.progress = progress
        self.paths = IpcPaths.create()
        self.channel: Optional[ServerChannel] = ServerChannel(self.paths)
        self.process: Optional[multiprocessing.Process] = None
        self.info: Dict[str, Any] = {}
        self.restarting = False
        self._recv_task: Optional[asyncio.Task] = None
        self._label = "the scheduler" if args.dp_size == 1 else f"scheduler replica {rank}"

    def send(self, obj: Any) -> None:
        self.channel.send(obj)

    def spawn(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        name = "lmprog-scheduler" if self.args.dp_size == 1 else f"lmprog-scheduler-dp{self.rank}"
        self.process = ctx.Process(target=run_scheduler_process, args=(self.args, self.paths),
                                   name=name, daemon=True)
        self.process.start()

    async def wait_ready(self) -> Dict[str, Any]:
        """The child's SchedulerReady info; RuntimeError when it fails or exits first."""
        t0 = time.monotonic()
        where = "the scheduler process" if self.args.dp_size == 1 else f"scheduler replica {self.rank}"
        self.progress(f"Loading model {self.args.model_path!r} in {where} (pid {self.process.pid})...")
        while True:
            try:
                msg = await self.channel.recv(timeout=PROGRESS_EVERY_S)
            except asyncio.TimeoutError:
                if not self.process.is_alive():
                    raise RuntimeError(f"{self._label} process exited with code {self.process.exitcode} "
                                       "while loading the model")
                self.progress(f"  still loading... {time.monotonic() - t0:.0f}s")
                continue
            if isinstance(msg, SchedulerFailed):
                raise RuntimeError(f"{self._label} failed to start: {msg.message}")
            if isinstance(msg, SchedulerReady):
                info = msg.info
                self.progress(f"Model loaded in {time.monotonic() - t0:.1f}s: context {info['context_len']} "
                              f"tokens, KV pool {info['max_total_num_tokens']} tokens, "
                              f"device {info.get('device') or '?'}")
                self.info = info
                return info

    def attach(self, on_message: Callable[[int, Any], None], on_exit: Callable[[int], None]) -> None:
        """Start feeding messages (tagged with the rank) and watching the child's exit."""
        self._recv_task = asyncio.create_task(self.channel.receive_loop(lambda obj: on_message(self.rank, obj)))
        asyncio.get_running_loop().add_reader(self.process.sentinel, on_exit, self.rank)

    async def detach(self, grace_s: float = 5.0) -> None:
        """Stop receiving and watching; reap the (dead) child so no second peer is on the sockets."""
        loop = asyncio.get_running_loop()
        if self.process is not None and self.process.pid is not None:
            loop.remove_reader(self.process.sentinel)
        await self._cancel_recv()
        if self.process is not None and self.process.pid is not None:
            await loop.run_in_executor(None, reap, self.process, grace_s)

    def unwatch(self) -> None:
        asyncio.get_running_loop().remove_reader(self.process.sentinel)
        self.process.join(timeout=1)

    async def _cancel_recv(self) -> None:
        if self._recv_task is not None:
            self._recv_task.cancel()
            await asyncio.gather(self._recv_task, return_exceptions=True)
            self._recv_task = None

    async def stop(self) -> None:
        if self.channel is not None and self.process is not None and self.process.is_alive():
            self.channel.send(ShutdownReq())
        if self.process is not None and self.process.pid is not None:  # started
            await asyncio.get_running_loop().run_in_executor(None, reap, self.process)
        await self._cancel_recv()
        if self.channel is not None:
            self.channel.close()
            self.channel = None


def reap(process: multiprocessing.Process, grace_s: float = SHUTDOWN_GRACE_S) -> None:
    process.join(grace_s)
    if process.is_alive():
        process.terminate()
        process.join(5)
    if process.is_alive():
        process.kill()
        process.join(5)
