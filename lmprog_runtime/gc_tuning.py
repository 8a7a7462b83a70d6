"""Python's cyclic garbage collector in the server's long-running processes.

A full (generation 2) collection walks every tracked object of the process. After start-up
the scheduler process holds ~220k of them (torch, the tokenizer, the model's modules, grammar
tables), and one full collection measured ~100 ms there (SmolLM2, 60 JSON-schema requests,
AVX2 EPYC): a stall of every running request's next token. `freeze()` moves everything alive
into the permanent generation, which collections skip: the same collection measured ~10 ms.
But on CPython 3.11 here a frozen process also decoded 10-20% slower, with no collection
running (batch-1 decode 137 -> 104 tokens/s in-process, 117 -> 96-100 through the server,
gc.freeze alone, gc.collect alone not; cause not found), so nothing freezes on its own:
`POST /freeze_gc` (`Engine.freeze_gc`) is there for a deployment whose measurements favour it.

`GcMonitor` times every collection (gc.callbacks) per generation; the scheduler reports the
counts and pauses in its internal state, and `--gc-warning-threshold-secs` logs a warning for
each collection longer than that.
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Optional

logger = logging.getLogger(__name__)


def freeze() -> int:
    """Collect, then freeze every object alive now; returns the permanent generation's size.
    That one collection is asked for, not a pause of serving: the monitor does not count it."""
    mon = _MONITOR
    if mon is not None:
        mon.uninstall()
    try:
        gc.collect()
    finally:
        if mon is not None:
            mon.install()
    gc.freeze()
    return gc.get_freeze_count()


class GcMonitor:
    """Counts and times the collections of this process (all threads)."""

    def __init__(self, warn_s: float = 0.0):
        self.warn_s = warn_s
        self.counts = [0, 0, 0]
        self.total_s = [0.0, 0.0, 0.0]
        self.max_s = [0.0, 0.0, 0.0]
        self._t0: Optional[float] = None

    def _callback(self, phase: str, info: dict) -> None:
        # collections run under the GIL, one at a time: one start time suffices
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        if self._t0 is None:  # installed during a collection
            return
        dt, self._t0 = time.perf_counter() - self._t0, None
        g = info.get("generation", 2)
        self.counts[g] += 1
        self.total_s[g] += dt
        self.max_s[g] = max(self.max_s[g], dt)
        if self.warn_s and dt > self.warn_s:
            logger.warning("a generation-%d garbage collection took %.3f s (collected %d objects; "
                           "--gc-warning-threshold-secs %g; POST /freeze_gc freezes what is alive now)",
                           g, dt, info.get("collected", 0), self.warn_s)

    def install(self) -> "GcMonitor":
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)
        return self

    def uninstall(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def stats(self) -> dict:
        return {"gc_collections": list(self.counts), "gc_pause_s_total": [round(t, 6) for t in self.total_s],
                "gc_pause_s_max": [round(t, 6) for t in self.max_s], "gc_frozen_objects": gc.get_freeze_count()}


_MONITOR: Optional[GcMonitor] = None


def monitor(warn_s: float = 0.0) -> GcMonitor:
    """The process's monitor, installed on first use (a later call updates the threshold)."""
    global _MONITOR
    if _MONITOR is None:
        _MONITOR = GcMonitor(warn_s).install()
    _MONITOR.warn_s = warn_s
    return _MONITOR
