"""Start and stop the servers under test as subprocesses, each logging to a file.

    with LmprogServer(port=30100, disable_radix_cache=True) as url: ...
    with LlamaCppServer(port=30200) as url: ...     # raises Unavailable without llama_cpp

`command` is the exact command line, for the report.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from typing import List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Unavailable(RuntimeError):
    """The system cannot run here (not installed); the benchmark skips it with this message."""


class ManagedServer:
    name = "server"
    ready_path = "/v1/models"  # answers 200 once the server can take requests

    def __init__(self, port: int, log_path: Optional[str] = None, ready_timeout: float = 900.0):
        self.port, self.ready_timeout = port, ready_timeout
        self.log_path = log_path or os.path.join(ROOT, "bench", "results", "logs", f"{self.name}.log")
        self.proc: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def argv(self) -> List[str]:
        raise NotImplementedError

    @property
    def command(self) -> str:
        return shlex.join(["python"] + self.argv()[1:])

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> "ManagedServer":
        """Start the process (its own process group, log at log_path); `wait_ready` waits."""
        os.makedirs(os.path.dirname(self.log_path), exist_ok=True)
        log = open(self.log_path, "w")
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        self.proc = subprocess.Popen(self.argv(), stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                                     start_new_session=True)
        log.close()
        return self

    def __enter__(self) -> str:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self.url

    def __exit__(self, *exc) -> None:
        self.stop()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with code {self.proc.returncode} while starting; "
                                   f"see {self.log_path}:\n{self._log_tail()}")
            try:
                with urllib.request.urlopen(self.url + self.ready_path, timeout=5) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.1)  # fine enough to time a start in seconds
        raise TimeoutError(f"{self.name} not ready after {self.ready_timeout:.0f}s; see {self.log_path}")

    def _log_tail(self, lines: int = 15) -> str:
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])

    def stop(self) -> None:
        """SIGTERM the server's own process group (it started it), then SIGKILL if it lingers."""
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue


class LmprogServer(ManagedServer):
    def __init__(self, port: int, disable_radix_cache: bool = False, model_path: str = "default",
                 extra_args: Optional[List[str]] = None, **kw):
        self.disable_radix_cache, self.model_path = disable_radix_cache, model_path
        self.extra_args = list(extra_args or [])
        self.name = "lmprog-nocache" if disable_radix_cache else "lmprog"
        super().__init__(port, **kw)

    def argv(self) -> List[str]:
        argv = [sys.executable, "-m", "lmprog_runtime", "serve", "--model-path", self.model_path,
                "--port", str(self.port), "--log-level", "warning"] + self.extra_args
        return argv + (["--disable-radix-cache"] if self.disable_radix_cache else [])


def llama_cpp_available() -> Optional[str]:
    """None when llama.cpp's server can run here, else why not."""
    if importlib.util.find_spec("llama_cpp") is None:
        return ("llama_cpp is not importable: install it with "
                "`.venv/bin/pip install 'llama-cpp-python[server]'` (builds llama.cpp from source)")
    for dep in ("uvicorn", "fastapi", "sse_starlette", "starlette_context", "pydantic_settings"):
        if importlib.util.find_spec(dep) is None:
            return f"llama_cpp is installed without its [server] extra ({dep} missing)"
    return None


def default_gguf() -> str:
    from lmprog_runtime.model_paths import default_gguf_path
    return default_gguf_path()


class LlamaCppServer(ManagedServer):
    """llama-cpp-python's server (`llama_cpp.server`) on the same SmolLM2 GGUF file lmprog serves.

    `logits_all` lets `/v1/completions` echo prompt logprobs (needed by `select`);
    `n_threads` defaults to every core, as lmprog's torch does. `no_extra_bufts` (default:
    on CPUs with AMX) works around llama.cpp's AMX crash, see `llama_cpp_server.py`.
    """

    name = "llama.cpp"

    def __init__(self, port: int, model: Optional[str] = None, n_ctx: int = 4096, n_threads: Optional[int] = None,
                 logits_all: bool = False, no_extra_bufts: Optional[bool] = None,
                 extra_args: Optional[List[str]] = None, **kw):
        reason = llama_cpp_available()
        if reason:
            raise Unavailable(reason)
        from bench.baselines.llama_cpp_server import cpu_has_amx

        self.model = model or default_gguf()
        self.n_ctx, self.n_threads, self.logits_all = n_ctx, n_threads or os.cpu_count(), logits_all
        self.no_extra_bufts = cpu_has_amx() if no_extra_bufts is None else no_extra_bufts
        self.extra_args = list(extra_args or [])
        super().__init__(port, **kw)

    def argv(self) -> List[str]:
        launcher = os.path.join("bench", "baselines", "llama_cpp_server.py")
        return [sys.executable, launcher] + (["--no-extra-bufts"] if self.no_extra_bufts else []) + [
                "--model", self.model, "--port", str(self.port),
                "--host", "127.0.0.1", "--n_ctx", str(self.n_ctx), "--n_threads", str(self.n_threads),
                "--n_threads_batch", str(self.n_threads), "--logits_all", str(self.logits_all),
                "--model_alias", "SmolLM2-135M-Instruct",
                "--interrupt_requests", "False"] + self.extra_args  # default True: a new request cuts the running one


def sglang_router_available() -> Optional[str]:
    """None when SGLang's router (PyPI sglang-router) can run here, else why not."""
    if importlib.util.find_spec("sglang_router") is None:
        return "sglang_router is not importable: install it with `.venv/bin/pip install sglang-router`"
    return None


class SglangRouter(ManagedServer):
    """SGLang's Rust gateway (`python -m sglang_router.launch_router`) in front of workers.

    Ready when its /health answers 200 (it has found every worker healthy)."""

    name = "sglang-router"
    ready_path = "/health"

    def __init__(self, port: int, worker_urls: List[str], policy: str = "cache_aware",
                 extra_args: Optional[List[str]] = None, **kw):
        reason = sglang_router_available()
        if reason:
            raise Unavailable(reason)
        self.worker_urls, self.policy = list(worker_urls), policy
        self.extra_args = list(extra_args or [])
        super().__init__(port, **kw)

    def argv(self) -> List[str]:
        return [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                "--port", str(self.port), "--policy", self.policy, "--log-level", "warn",
                "--worker-urls", *self.worker_urls] + self.extra_args
