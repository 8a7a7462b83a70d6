"""`lmprog-runtime serve`: the two-process server.

    server process (this one)                     scheduler process (spawned)
    aiohttp app + TokenizerManager   <── ipc ──>  build_scheduler(args).run_forever(...)

Start-up: listen first (a taken port fails before any loading; every route answers 503
"loading" with its progress until the model is in), spawn the scheduler, load the
tokenizer meanwhile, print a progress line until the child sends `SchedulerReady` (or
`SchedulerFailed`). The child is watched through its process sentinel: if it dies, every
open request fails with a 503, every route answers 503, and the server either starts a new
scheduler (at most --scheduler-restart times; counted in `lmprog:scheduler_restarts`) or
exits with code 3 for a supervisor to restart it. SIGINT/SIGTERM stop the listener, tell the scheduler to
shut down, join (then terminate) it and remove the IPC files.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing
import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, Optional

from lmprog_runtime.config import ServerArgs, add_cli_args, from_cli_namespace, limit_malloc_arenas
from lmprog_runtime.ipc import IpcPaths, SchedulerChannel, ServerChannel
from lmprog_runtime.messages import SchedulerFailed, SchedulerReady, ShutdownReq

logger = logging.getLogger("lmprog_runtime.server")

PROGRESS_EVERY_S = 5.0
SHUTDOWN_GRACE_S = 10.0
EXIT_SCHEDULER_DIED = 3  # the exit code after the scheduler process died


# -- the scheduler process --------------------------------------------------------------------
def run_scheduler_process(args: ServerArgs, paths: IpcPaths) -> None:
    """Entry point of the spawned child: load the model, report, run the batch loop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the group; the server stops us
    _setup_logging(args.log_level)
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


# -- the server side of the runtime ---------------------------------------------------------
class ServerRuntime:
    """Owns the scheduler child, the channel and the TokenizerManager of one server."""

    def __init__(self, args: ServerArgs, progress: Callable[[str], None] = print):
        self.args = args
        self._print = progress
        self.paths: Optional[IpcPaths] = None
        self.channel: Optional[ServerChannel] = None
        self.process: Optional[multiprocessing.Process] = None
        self.tm = None
        self.metrics = None
        self.tokenizer = None
        self.info: Dict[str, Any] = {}
        self.model_info: Dict[str, Any] = {}
        self.start_time = time.time()
        self.last_output_time = 0.0
        self.stopping = False
        self._recv_task: Optional[asyncio.Task] = None
        self.load_started = time.monotonic()
        self.load_status = "starting"  # the last progress line while loading
        self.schemas: Dict[str, dict] = {}
        self.max_token_bytes = 1
        self.tokenize_pool = ThreadPoolExecutor(1, thread_name_prefix="tokenize")  # one: the tokenizer is shared
        self.on_dead: Callable[[str], None] = lambda message: None  # serve() exits non-zero
        self.restarts = 0  # scheduler restarts so far (bounded by --scheduler-restart)
        self.restarting = False
        self._restart_task: Optional[asyncio.Task] = None

    @property
    def dead(self) -> Optional[str]:
        """None when serving; otherwise why not ("loading" while the model loads)."""
        return self.tm.dead if self.tm is not None else "loading"

    def unavailable_message(self) -> str:
        if self.tm is None:
            return (f"The server is loading the model ({time.monotonic() - self.load_started:.0f}s so far); "
                    "retry when /health answers 200.")
        if self.restarting:
            return (f"The scheduler is restarting ({self.restarts}/{self.args.scheduler_restart}) after: "
                    f"{self.tm.dead}")
        return f"The scheduler is not running: {self.tm.dead}"

    def state_fields(self) -> Dict[str, Any]:
        """Top-level keys of a 503 envelope: the state, and while loading its progress."""
        if self.tm is None:
            return {"status": "loading", "progress": {"elapsed_s": round(time.monotonic() - self.load_started, 1),
                                                      "message": self.load_status}}
        return {"status": "restarting" if self.restarting else "dead", "restarts": self.restarts}

    def progress(self, line: str) -> None:
        self.load_status = line.strip()
        self._print(line)

    async def start(self) -> None:
        from lmprog_runtime.server.metrics import ServerMetrics
        from lmprog_runtime.server.schema import Limits, request_schemas
        from lmprog_runtime.tokenizer_manager import TokenizerManager

        self.paths = IpcPaths.create()
        self.channel = ServerChannel(self.paths)
        self._spawn()
        loop = asyncio.get_running_loop()
        tokenizer = loop.run_in_executor(None, _load_tokenizer, self.args)
        try:
            self.info = await self._wait_ready()
        except BaseException:
            tokenizer.add_done_callback(lambda f: f.cancelled() or f.exception())  # already reported
            raise
        self.tokenizer = await tokenizer
        self.model_info = self.info["model_info"]
        self.metrics = ServerMetrics(self.model_info["served_model_name"])
        self.schemas = request_schemas(Limits.of(self.args, self.info["vocab_size"]))
        self.max_token_bytes = _max_token_bytes(self.tokenizer)
        self.tm = TokenizerManager(self.tokenizer, self.info["vocab_size"], self.info["context_len"],
                                   self.channel.send, on_finish=self.metrics.on_finish,
                                   incremental_streaming=self.args.incremental_streaming_output)
        self.tm.weight_version = self.info.get("weight_version", "default")
        self._recv_task = asyncio.create_task(self.channel.receive_loop(self._on_message))
        loop.add_reader(self.process.sentinel, self._on_child_exit)

    def _spawn(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.process = ctx.Process(target=run_scheduler_process, args=(self.args, self.paths),
                                   name="lmprog-scheduler", daemon=True)
        self.process.start()

    async def _wait_ready(self) -> Dict[str, Any]:
        t0 = time.monotonic()
        self.progress(f"Loading model {self.args.model_path!r} in the scheduler process "
                      f"(pid {self.process.pid})...")
        while True:
            try:
                msg = await self.channel.recv(timeout=PROGRESS_EVERY_S)
            except asyncio.TimeoutError:
                if not self.process.is_alive():
                    raise RuntimeError(f"the scheduler process exited with code {self.process.exitcode} "
                                       "while loading the model")
                self.progress(f"  still loading... {time.monotonic() - t0:.0f}s")
                continue
            if isinstance(msg, SchedulerFailed):
                raise RuntimeError(f"the scheduler failed to start: {msg.message}")
            if isinstance(msg, SchedulerReady):
                info = msg.info
                self.progress(f"Model loaded in {time.monotonic() - t0:.1f}s: context {info['context_len']} "
                              f"tokens, KV pool {info['max_total_num_tokens']} tokens, "
                              f"device {info.get('device') or '?'}")
                return info

    def _on_message(self, obj) -> None:
        if isinstance(obj, SchedulerFailed):
            logger.error("scheduler failed: %s", obj.message)
            self._scheduler_down(obj.message)
            return
        self.last_output_time = time.monotonic()
        self.tm.handle_output(obj)

    def _on_child_exit(self) -> None:
        asyncio.get_running_loop().remove_reader(self.process.sentinel)
        self.process.join(timeout=1)
        if self.stopping:
            return
        message = f"the scheduler process exited unexpectedly (exit code {self.process.exitcode})"
        logger.error(message)
        self._scheduler_down(message)

    def _scheduler_down(self, message: str) -> None:
        """Fail every open request (503), then restart the scheduler while --scheduler-restart
        allows, else tell serve() to exit non-zero."""
        if not self.tm.dead:
            self.tm.fail_all(message)
        if self.restarting or self.stopping:
            return
        if self.restarts < self.args.scheduler_restart:
            self.restarting = True
            self._restart_task = asyncio.create_task(self._restart())
        else:
            self.on_dead(self.tm.dead)

    async def _restart(self) -> None:
        loop = asyncio.get_running_loop()
        self.restarts += 1
        self.metrics.scheduler_restarts.labels(self.metrics.model_name).inc()
        loop.remove_reader(self.process.sentinel)
        if self._recv_task is not None:
            self._recv_task.cancel()
            await asyncio.gather(self._recv_task, return_exceptions=True)
        await loop.run_in_executor(None, _reap, self.process, 5.0)  # no second peer on the sockets
        self.progress(f"Restarting the scheduler ({self.restarts}/{self.args.scheduler_restart})...")
        self._spawn()
        try:
            self.info.update(await self._wait_ready())
        except Exception as e:  # noqa: BLE001 - a restart that fails ends the server
            self.restarting = False
            self.on_dead(f"the scheduler restart failed: {e}")
            return
        self.tm.control_waiters.clear()  # futures of the dead scheduler, already failed
        self.tm.weight_version = self.info.get("weight_version", "default")  # a new scheduler's weights
        self.tm.dead = None
        self.restarting = False
        self._recv_task = asyncio.create_task(self.channel.receive_loop(self._on_message))
        loop.add_reader(self.process.sentinel, self._on_child_exit)

    def server_info(self) -> Dict[str, Any]:
        info = self.args.to_dict()
        if info.get("api_key"):
            info["api_key"] = "<hidden>"
        info.update(
            status="dead" if self.dead else "ready",
            max_total_num_tokens=self.info.get("max_total_num_tokens"),
            max_req_input_len=self.info.get("max_req_input_len"),
            context_length=self.info.get("context_len"),
            startup_time=self.start_time, scheduler_pid=self.info.get("pid"),
            launch_command=_redacted_command(sys.argv))
        return info

    async def stop(self) -> None:
        self.stopping = True
        if self.channel is not None and self.process is not None and self.process.is_alive():
            self.channel.send(ShutdownReq())
        if self.process is not None and self.process.pid is not None:  # started
            await asyncio.get_running_loop().run_in_executor(None, _reap, self.process)
        if self._recv_task is not None:
            self._recv_task.cancel()
            try:
                await self._recv_task
            except asyncio.CancelledError:
                pass
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        self.tokenize_pool.shutdown(wait=False, cancel_futures=True)


def _redacted_command(argv) -> str:
    out, hide = [], False
    for a in argv:
        out.append("<hidden>" if hide else ("--api-key=<hidden>" if a.startswith("--api-key=") else a))
        hide = a == "--api-key"
    return " ".join(out)


def _reap(process: multiprocessing.Process, grace_s: float = SHUTDOWN_GRACE_S) -> None:
    process.join(grace_s)
    if process.is_alive():
        process.terminate()
        process.join(5)
    if process.is_alive():
        process.kill()
        process.join(5)


def _max_token_bytes(tokenizer) -> int:
    """Bytes of the longest token (byte-level vocabularies spell one byte per character;
    x4 covers vocabularies that spell real UTF-8 characters)."""
    try:
        return max(4 * max(len(t) for t in tokenizer.get_vocab()), 16)
    except AttributeError:  # a tokenizer without get_vocab: no early length check
        return 1 << 20


def _load_tokenizer(args: ServerArgs):
    from lmprog_runtime.tokenizer import load_tokenizer  # torch-free: this process runs no model code

    return load_tokenizer(args.tokenizer_path or args.model_path)


# -- serving --------------------------------------------------------------------------------
async def serve(args: ServerArgs, progress: Callable[[str], None] = print) -> int:
    """Listen first (503 "loading" until the model is in), then serve until SIGINT/SIGTERM
    (exit code 0) or until the scheduler dies (in-flight requests fail with 503, then exit
    code 3 so that a supervisor restarts the server). OSError when the port is taken,
    RuntimeError when the model cannot be loaded."""
    from lmprog_runtime.server.http import EnvelopeAppRunner, create_app

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    exit_code = [0]
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    runtime = ServerRuntime(args, progress)

    def on_dead(message: str) -> None:
        progress(f"The scheduler died ({message}); failing open requests and exiting.")
        exit_code[0] = EXIT_SCHEDULER_DIED
        stop.set()

    runtime.on_dead = on_dead
    runner = EnvelopeAppRunner(create_app(runtime), handler_cancellation=True, access_log=None,
                               shutdown_timeout=SHUTDOWN_GRACE_S)
    try:
        await runner.setup()
        await web_site(runner, args).start()  # before loading: a taken port fails now
        progress(f"Listening on http://{args.host}:{args.port} (503 'loading' until the model is ready)")
        starting = asyncio.create_task(runtime.start())
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():  # a signal while loading
            starting.cancel()
            progress("Interrupted while loading; shutting down.")
            return 0
        starting.result()
        progress(f"Serving {runtime.model_info['served_model_name']!r} on http://{args.host}:{args.port} "
                 "(Ctrl-C to stop)")
        await stopping
        progress("Shutting down...")
    finally:
        if runtime.tm is not None and not runtime.tm.dead:  # end open streams now, not after a timeout
            runtime.tm.abort(abort_all=True)
            runtime.tm.fail_all("the server is shutting down")
        await runner.cleanup()
        await runtime.stop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    return exit_code[0]


def web_site(runner, args: ServerArgs):
    from aiohttp import web

    return web.TCPSite(runner, args.host, args.port)


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="[%(asctime)s %(processName)s] %(levelname)s %(message)s",
                        datefmt="%H:%M:%S")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lmprog-runtime",
                                     description="The lmprog serving runtime (SGLang- and OpenAI-compatible).")
    sub = parser.add_subparsers(dest="command")
    serve_parser = sub.add_parser("serve", help="start the HTTP server")
    add_cli_args(serve_parser)
    return parser


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv.insert(0, "serve")  # `lmprog-runtime --port 8000` means serve
    ns = build_parser().parse_args(argv)
    try:
        args = from_cli_namespace(ns)
    except (ValueError, TypeError) as e:
        print(f"lmprog-runtime: error: {e}", file=sys.stderr)
        return 2
    if not isinstance(logging.getLevelName(args.log_level.upper()), int):
        print(f"lmprog-runtime: error: unknown --log-level {args.log_level!r}", file=sys.stderr)
        return 2
    _setup_logging(args.log_level)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    limit_malloc_arenas()
    try:
        return asyncio.run(serve(args, progress=lambda line: print(line, flush=True)))
    except RuntimeError as e:
        print(f"lmprog-runtime: {e}", file=sys.stderr, flush=True)
        return 1
    except OSError as e:  # e.g. the port is taken: found before the model loads
        print(f"lmprog-runtime: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
