"""Start and stop a real `python -m lmprog_runtime serve` on 127.0.0.1 and a free port.

Used by `tests/server/conftest.py` (the session-scoped `live_server` fixture) and by the
tests that need a server of their own (auth, scheduler death, shutdown).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from typing import List, Optional

import requests

STARTUP_TIMEOUT_S = 240  # two shared CPU cores: importing torch and transformers is slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_is_free(port: int) -> bool:
    """True when a new server could listen on `port` (TIME_WAIT leftovers do not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


class LiveServer:
    def __init__(self, model_path: str, log_dir, extra_args: List[str] = (), env: Optional[dict] = None):
        """`env`: extra environment variables of the server process."""
        self.env = dict(env or {})
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = os.path.join(str(log_dir), f"server-{self.port}.log")
        self.argv = [sys.executable, "-m", "lmprog_runtime", "serve", "--model-path", str(model_path),
                     "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32",
                     "--max-total-tokens", "8192", "--num-threads", "1",
                     "--log-level", "warning", *extra_args]
        self.proc: Optional[subprocess.Popen] = None

    def start(self) -> "LiveServer":
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **self.env}
        repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = repo + os.pathsep + env.get("PYTHONPATH", "")
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=repo)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if requests.get(self.url + "/health", timeout=5).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.5)
        self.stop(signal.SIGKILL)
        raise RuntimeError(f"server did not become healthy in {STARTUP_TIMEOUT_S}s:\n{self.log_tail()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> Optional[int]:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            raise

    def log_tail(self, n: int = 4000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read().decode(errors="replace")[-n:]
        except OSError:
            return ""


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie still answers kill(0); treat it as gone
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def internal_state(url: str, headers=None) -> dict:
    info = requests.get(url + "/get_server_info", headers=headers, timeout=30).json()
    return info["internal_states"][0]


def wait_idle(url: str, timeout: float = 30, headers=None) -> dict:
    """The scheduler's internal state once nothing runs or waits (integrity is audited then)."""
    deadline = time.monotonic() + timeout
    while True:
        state = internal_state(url, headers)
        if state["num_running_reqs"] == 0 and state["num_queue_reqs"] == 0 and state["integrity"] != "busy":
            return state
        if time.monotonic() > deadline:
            raise AssertionError(f"the server did not go idle: {state}")
        time.sleep(0.05)
