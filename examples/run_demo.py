"""`make run`: start the server on the embedded model, run example programs against it,
shut the server down.

    python examples/run_demo.py [--port 30000] [--keep-serving]
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = ["quickstart.py", "fork_join_agent.py", "json_extraction.py"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with code {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"the server at {url} did not become healthy within {timeout:.0f} s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, default=None, help="default: a free port")
    ap.add_argument("--model-path", default="default")
    ap.add_argument("--keep-serving", action="store_true", help="leave the server running after the examples")
    args = ap.parse_args()

    port = args.port or free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "lmprog_runtime", "serve", "--model-path", args.model_path,
           "--host", "127.0.0.1", "--port", str(port)]
    print(f"$ {' '.join(cmd)}", flush=True)
    server = subprocess.Popen(cmd)
    try:
        wait_healthy(url, server)
        print(f"server ready at {url}\n", flush=True)
        for name in EXAMPLES:
            path = os.path.join(HERE, name)
            if not os.path.exists(path):
                continue
            print(f"=== examples/{name} ===", flush=True)
            subprocess.run([sys.executable, path, "--url", url], check=True)
            print(flush=True)
        if args.keep_serving:
            print(f"serving at {url}; Ctrl-C to stop", flush=True)
            server.wait()
    except KeyboardInterrupt:
        pass
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGINT)
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
