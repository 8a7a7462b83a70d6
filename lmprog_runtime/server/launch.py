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

With `--dp-size N` there are N scheduler children (server/replica.py), each its own model
copy, pool, radix cache and IPC folder, behind one dispatcher (server/data_parallel.py). A
replica that dies fails only the requests it held and is restarted within the same
--scheduler-restart budget; the server goes 503 and exits with code 3 only when no replica
is left (docs/scale-out.md).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Optional

from lmprog_runtime.config import ServerArgs, add_cli_args, from_cli_namespace, limit_malloc_arenas
from lmprog_runtime.messages import SchedulerFailed
from lmprog_runtime.server.data_parallel import Dispatcher, replica_args
from lmprog_runtime.server.replica import SHUTDOWN_GRACE_S, SchedulerReplica, setup_logging

logger = logging.getLogger("lmprog_runtime.server")

EXIT_SCHEDULER_DIED = 3  # the exit code after the scheduler process died


# -- the server side of the runtime ---------------------------------------------------------
class ServerRuntime:
    """Owns the scheduler children (one per --dp-size replica), the dispatcher between them
    and the TokenizerManager of one server."""

    def __init__(self, args: ServerArgs, progress: Callable[[str], None] = print):
        self.args = args
        self._print = progress
        self.replicas: List[SchedulerReplica] = []
        self.dispatcher: Optional[Dispatcher] = None
        self.tm = None
        self.metrics = None
        self.tokenizer = None
        self.model_info: Dict[str, Any] = {}
        self.start_time = time.time()
        self.last_output_time = 0.0
        self.stopping = False
        self.load_started = time.monotonic()
        self.load_status = "starting"  # the last progress line while loading
        self.schemas: Dict[str, dict] = {}
        self.max_token_bytes = 1
        self.tokenize_pool = ThreadPoolExecutor(1, thread_name_prefix="tokenize")  # one: the tokenizer is shared
        self.on_dead: Callable[[str], None] = lambda message: None  # serve() exits non-zero
        self.restarts = 0  # scheduler restarts so far, all replicas (bounded by --scheduler-restart)
        self._restart_tasks: Dict[int, asyncio.Task] = {}

    @property
    def info(self) -> Dict[str, Any]:
        """Replica 0's start-up info (model, context, pool size, pid)."""
        return self.replicas[0].info if self.replicas else {}

    @property
    def restarting(self) -> bool:
        return any(rep.restarting for rep in self.replicas)

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

        self.replicas = [SchedulerReplica(replica_args(self.args, r), r, self.progress)
                         for r in range(self.args.dp_size)]
        for rep in self.replicas:
            rep.spawn()
        loop = asyncio.get_running_loop()
        # A GGUF whose tokenizer is not converted yet: the schedulers convert it into the cache
        # while they load (loader.py), so this process reads it after them instead of parsing
        # the file in a child of its own beside them (on 2 cores the two compete for the CPU).
        tokenizer = loop.run_in_executor(None, _load_tokenizer, self.args) if _tokenizer_ready(self.args) else None
        try:
            await _all_ready(self.replicas)
        except BaseException:
            if tokenizer is not None:
                tokenizer.add_done_callback(lambda f: f.cancelled() or f.exception())  # already reported
            raise
        self.tokenizer = await (tokenizer or loop.run_in_executor(None, _load_tokenizer, self.args))
        self.model_info = self.info["model_info"]
        self.metrics = ServerMetrics(self.model_info["served_model_name"])
        self.schemas = request_schemas(Limits.of(self.args, self.info["vocab_size"]))
        self.max_token_bytes = _max_token_bytes(self.tokenizer)
        self.dispatcher = Dispatcher([rep.send for rep in self.replicas], self.args.load_balance_method,
                                     deliver=lambda obj: self.tm.handle_output(obj))
        self.tm = TokenizerManager(self.tokenizer, self.info["vocab_size"], self.info["context_len"],
                                   self.dispatcher.send, on_finish=self.metrics.on_finish,
                                   incremental_streaming=self.args.incremental_streaming_output)
        self.tm.weight_version = self.info.get("weight_version", "default")
        for rep in self.replicas:
            rep.attach(self._on_message, self._on_child_exit)

    def _on_message(self, rank: int, obj) -> None:
        if isinstance(obj, SchedulerFailed):
            logger.error("scheduler failed: %s", obj.message)
            self._replica_down(rank, obj.message)
            return
        self.last_output_time = time.monotonic()
        self.dispatcher.on_message(rank, obj)

    def _on_child_exit(self, rank: int) -> None:
        rep = self.replicas[rank]
        rep.unwatch()
        if self.stopping:
            return
        who = "the scheduler process" if self.args.dp_size == 1 else f"scheduler replica {rank}"
        message = f"{who} exited unexpectedly (exit code {rep.process.exitcode})"
        logger.error(message)
        self._replica_down(rank, message)

    def _replica_down(self, rank: int, message: str) -> None:
        """Fail the requests replica `rank` held (503; all of them when it was the last live
        one), then restart it while --scheduler-restart allows; with no live replica left and
        no restart under way tell serve() to exit non-zero."""
        if self.dispatcher.alive[rank]:
            rids = self.dispatcher.replica_down(rank)
            if not self.dispatcher.live_ranks():
                self.tm.fail_all(message)
            else:
                self.tm.fail_requests(rids, message)
        rep = self.replicas[rank]
        if rep.restarting or self.stopping:
            return
        if self.restarts < self.args.scheduler_restart:
            rep.restarting = True
            self._restart_tasks[rank] = asyncio.create_task(self._restart(rank))
        elif not self.dispatcher.live_ranks() and not self.restarting:
            self.on_dead(self.tm.dead)
        else:
            logger.error("serving on with %d of %d replicas", len(self.dispatcher.live_ranks()), len(self.replicas))

    async def _restart(self, rank: int) -> None:
        rep = self.replicas[rank]
        self.restarts += 1
        self.metrics.scheduler_restarts.labels(self.metrics.model_name).inc()
        await rep.detach(5.0)  # no second peer on the sockets
        who = "the scheduler" if self.args.dp_size == 1 else f"scheduler replica {rank}"
        self.progress(f"Restarting {who} ({self.restarts}/{self.args.scheduler_restart})...")
        rep.spawn()
        try:
            await rep.wait_ready()
        except Exception as e:  # noqa: BLE001 - a restart that fails ends the server (or this replica)
            rep.restarting = False
            if not self.dispatcher.live_ranks():
                self.on_dead(f"the scheduler restart failed: {e}")
            return
        if self.tm.dead:  # it was the last one: the server comes back with it
            self.tm.control_waiters.clear()  # futures of the dead scheduler, already failed
            self.tm.weight_version = rep.info.get("weight_version", "default")  # a new scheduler's weights
            self.tm.dead = None
        self.dispatcher.replica_up(rank)
        rep.restarting = False
        rep.attach(self._on_message, self._on_child_exit)

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
        if self.args.dp_size > 1:
            info["scheduler_pids"] = [rep.info.get("pid") for rep in self.replicas]
            info["dp_alive"] = list(self.dispatcher.alive) if self.dispatcher else []
        return info

    async def stop(self) -> None:
        self.stopping = True
        await asyncio.gather(*(rep.stop() for rep in self.replicas))
        self.tokenize_pool.shutdown(wait=False, cancel_futures=True)


async def _all_ready(replicas: List[SchedulerReplica]) -> None:
    """Wait for every replica's SchedulerReady; the first failure is raised after all are settled."""
    results = await asyncio.gather(*(rep.wait_ready() for rep in replicas), return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r


def _redacted_command(argv) -> str:
    out, hide = [], False
    for a in argv:
        out.append("<hidden>" if hide else ("--api-key=<hidden>" if a.startswith("--api-key=") else a))
        hide = a == "--api-key"
    return " ".join(out)


def _max_token_bytes(tokenizer) -> int:
    """Bytes of the longest token (byte-level vocabularies spell one byte per character;
    x4 covers vocabularies that spell real UTF-8 characters)."""
    try:
        return max(4 * max(len(t) for t in tokenizer.get_vocab()), 16)
    except AttributeError:  # a tokenizer without get_vocab: no early length check
        return 1 << 20


def _tokenizer_ready(args: ServerArgs) -> bool:
    """Whether this process can load the tokenizer without converting a GGUF (or the
    schedulers will not convert it for us: a separate --tokenizer-path)."""
    from lmprog_runtime.model_paths import is_gguf, resolve_model_path, tokenizer_folder_if_ready

    if args.tokenizer_path and args.tokenizer_path != args.model_path:
        return True
    try:
        path = resolve_model_path(args.model_path)
    except Exception:  # noqa: BLE001 - the load reports it
        return True
    return not is_gguf(path) or tokenizer_folder_if_ready(path) != path


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lmprog-runtime",
                                     description="The lmprog serving runtime (SGLang- and OpenAI-compatible).")
    sub = parser.add_subparsers(dest="command")
    serve_parser = sub.add_parser("serve", help="start the HTTP server")
    add_cli_args(serve_parser)
    from lmprog_runtime.plan_kv import add_plan_kv_args  # torch-free until it runs
    add_plan_kv_args(sub.add_parser("plan-kv", help="what moving a request's KV costs, and whether "
                                                    "prefill/decode disaggregation pays off (docs/plan-kv.md)"))
    return parser


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv.insert(0, "serve")  # `lmprog-runtime --port 8000` means serve
    ns = build_parser().parse_args(argv)
    if ns.command == "plan-kv":
        from lmprog_runtime.plan_kv import main as plan_kv_main
        return plan_kv_main(ns)
    try:
        args = from_cli_namespace(ns)
    except (ValueError, TypeError) as e:
        print(f"lmprog-runtime: error: {e}", file=sys.stderr)
        return 2
    if not isinstance(logging.getLevelName(args.log_level.upper()), int):
        print(f"lmprog-runtime: error: unknown --log-level {args.log_level!r}", file=sys.stderr)
        return 2
    setup_logging(args.log_level)
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
