"""A headless Chromium driven over the Chrome DevTools protocol (tests only).

Starts the system `chromium` (the Debian package) with `--remote-debugging-port=0`,
reads the websocket address it prints, and talks to one page target through aiohttp's
websocket client. Nothing is downloaded; `find_chromium()` is None when none is installed.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from typing import Any, Optional

import aiohttp

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "chrome")


def find_chromium() -> Optional[str]:
    for name in CANDIDATES:
        path = shutil.which(name)
        if path:
            return path
    return None


class Browser:
    """`async with Browser() as b: await b.goto(url); await b.eval("1 + 1")`."""

    def __init__(self, width: int = 1400, height: int = 1500):
        self.size = (width, height)
        self.proc: Optional[subprocess.Popen] = None
        self.profile = tempfile.mkdtemp(prefix="lmprog-chromium-")
        self.session: Optional[aiohttp.ClientSession] = None
        self.ws = None
        self._id = 0
        self.console: list = []  # console messages and page exceptions, in order

    async def __aenter__(self) -> "Browser":
        exe = find_chromium()
        argv = [exe, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--no-first-run", "--no-default-browser-check", "--disable-extensions",
                f"--user-data-dir={self.profile}", "--remote-debugging-port=0",
                "--remote-debugging-address=127.0.0.1", f"--window-size={self.size[0]},{self.size[1]}",
                "about:blank"]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        endpoint = await asyncio.get_running_loop().run_in_executor(None, self._read_endpoint)
        port = re.search(r":(\d+)/", endpoint).group(1)
        self.session = aiohttp.ClientSession()
        async with self.session.get(f"http://127.0.0.1:{port}/json/list") as r:
            pages = [t for t in await r.json() if t["type"] == "page"]
        self.ws = await self.session.ws_connect(pages[0]["webSocketDebuggerUrl"], max_msg_size=0)
        for domain in ("Page", "Runtime"):
            await self.send(f"{domain}.enable")
        await self.send("Emulation.setDeviceMetricsOverride", width=self.size[0], height=self.size[1],
                        deviceScaleFactor=1, mobile=False)
        return self

    def _read_endpoint(self, timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line and self.proc.poll() is not None:
                raise RuntimeError(f"chromium exited with {self.proc.returncode}")
            m = re.search(r"DevTools listening on (ws://\S+)", line)
            if m:
                return m.group(1)
        raise RuntimeError("chromium did not print its DevTools address")

    async def __aexit__(self, *exc) -> None:
        if self.ws is not None:
            await self.ws.close()
        if self.session is not None:
            await self.session.close()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        shutil.rmtree(self.profile, ignore_errors=True)

    async def send(self, method: str, **params) -> dict:
        """One protocol command; its `result` (events that arrive meanwhile are logged)."""
        self._id += 1
        my_id = self._id
        await self.ws.send_str(json.dumps({"id": my_id, "method": method, "params": params}))
        while True:
            msg = json.loads((await self.ws.receive()).data)
            if msg.get("id") == my_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            self._note(msg)

    def _note(self, msg: dict) -> None:
        if msg.get("method") == "Runtime.consoleAPICalled":
            args = msg["params"].get("args", [])
            self.console.append(" ".join(str(a.get("value", a.get("description", ""))) for a in args))
        elif msg.get("method") == "Runtime.exceptionThrown":
            self.console.append("EXCEPTION " + json.dumps(msg["params"]["exceptionDetails"])[:2000])

    async def goto(self, url: str, ready: str = "document.readyState === 'complete'", timeout: float = 30) -> None:
        await self.send("Page.navigate", url=url)
        await self.wait_for(ready, timeout)

    async def eval(self, expression: str) -> Any:
        """The value of a JS expression (promises awaited), JSON-serialized by the page."""
        res = await self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in res:
            raise RuntimeError(f"JS error in {expression[:80]!r}: {res['exceptionDetails']}")
        return res["result"].get("value")

    async def wait_for(self, expression: str, timeout: float = 30, poll_s: float = 0.2) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            value = await self.eval(f"(() => {{ try {{ return {expression}; }} catch (e) {{ return null; }} }})()")
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {timeout}s for {expression!r}; console: {self.console[-5:]}")
            await asyncio.sleep(poll_s)

    async def click(self, x: float, y: float, count: int = 1) -> None:
        """A left click (or double click: count=2) at page coordinates (CSS pixels)."""
        for n in range(1, count + 1):
            for kind in ("mousePressed", "mouseReleased"):
                await self.send("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=n)

    async def allow_downloads(self, folder: str) -> None:
        await self.send("Browser.setDownloadBehavior", behavior="allow", downloadPath=folder)

    async def screenshot(self, path: str) -> None:
        res = await self.send("Page.captureScreenshot", format="png", captureBeyondViewport=False)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "wb") as f:
            f.write(base64.b64decode(res["data"]))
