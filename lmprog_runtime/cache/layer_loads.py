"""Layer-wise asynchronous load-back (L2 → L1): host → device copies run on one copy
thread, layer by layer, while the forward that needs them computes.

`submit(copy_layer)` queues one load: the thread calls `copy_layer(layer)` for every layer
in order, and after each one the load's progress moves on. `wait(layer)` blocks until every
load submitted so far has copied `layer`; the device pool calls it in `set_kv`, which every
attention backend calls for a layer before it writes or reads that layer's KV, so the
forward of layer i waits only for layer i's pages. `drain()` blocks until every load is
done; every other reader or writer of the slots involved (device → host backups, L3 page
writes into host slots, a flush) drains first.

The thread runs loads first in, first out, so "the newest load copied layer i" implies
every older load is complete. A copy that raised makes every later `wait`/`drain` raise
(the forward fails, and with it the batch's requests; the scheduler goes on).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional


class LayerLoads:
    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self._cv = threading.Condition()
        self._submitted = 0     # loads queued (the scheduler thread writes it)
        self._finished = 0      # loads fully copied (the copy thread writes it)
        self._layers = 0        # layers copied of load number `_finished` (in progress)
        self._error: Optional[BaseException] = None
        self.copy_seconds = 0.0  # wall time the copy thread spent copying (all loads)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="lmprog-hicache-load")

    @property
    def pending(self) -> bool:
        return self._finished < self._submitted

    def submit(self, copy_layer: Callable[[int], None]) -> None:
        with self._cv:
            self._submitted += 1
        self._pool.submit(self._run, copy_layer)

    def _run(self, copy_layer: Callable[[int], None]) -> None:
        t0 = time.perf_counter()
        for layer in range(self.num_layers):
            try:
                if self._error is None:
                    copy_layer(layer)
            except BaseException as e:  # noqa: BLE001 - reported to the waiting forward
                self._error = e
            with self._cv:
                self._layers = layer + 1
                self._cv.notify_all()
        with self._cv:
            self.copy_seconds += time.perf_counter() - t0
            self._finished += 1
            self._layers = 0
            self._cv.notify_all()

    def wait(self, layer: int) -> None:
        """Block until every load submitted so far has copied `layer`."""
        if not self.pending and self._error is None:
            return
        with self._cv:
            target = self._submitted
            self._cv.wait_for(lambda: self._finished >= target
                              or (self._finished == target - 1 and self._layers > layer))
        self._raise()

    def drain(self) -> None:
        """Block until every load submitted so far is done."""
        if not self.pending and self._error is None:
            return
        with self._cv:
            target = self._submitted
            self._cv.wait_for(lambda: self._finished >= target)
        self._raise()

    def _raise(self) -> None:
        if self._error is not None:  # sticky: the slots of that load hold garbage the tree trusts
            raise RuntimeError(f"HiCache layer-wise load-back failed: {self._error!r}") from self._error

    def close(self) -> None:
        self._pool.shutdown(wait=True)
