"""Watchdog: a scheduler step that runs longer than `--watchdog-timeout` seconds is
logged, once per stuck step, with the stack of every thread (where the loop is stuck).

While a step is stuck the scheduler answers nothing, so the server's /health probe
times out and reports unhealthy; the dump says why. `trips` counts stuck steps (shown
as `watchdog_trips` in the internal state once the loop moves again).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import traceback
from typing import Optional

logger = logging.getLogger(__name__)


class Watchdog:
    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.trips = 0
        self._started: Optional[float] = None  # monotonic start of the running step
        self._reported = False
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        if self.timeout_s <= 0 or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._watch, name="lmprog-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def step_begin(self) -> None:
        self._reported = False
        self._started = time.monotonic()

    def step_end(self) -> None:
        self._started = None

    def _watch(self) -> None:
        period = min(max(self.timeout_s / 4, 0.01), 5.0)
        while not self._stop.wait(period):
            started = self._started
            if started is None or self._reported:
                continue
            stuck = time.monotonic() - started
            if stuck > self.timeout_s:
                self._reported = True
                self.trips += 1
                logger.error("watchdog: a scheduler step has run for %.1f s (--watchdog-timeout %.1f s)\n%s",
                             stuck, self.timeout_s, _all_stacks())


def _all_stacks() -> str:
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        parts.append(f"--- thread {names.get(ident, ident)} ---\n" + "".join(traceback.format_stack(frame)))
    return "\n".join(parts)
