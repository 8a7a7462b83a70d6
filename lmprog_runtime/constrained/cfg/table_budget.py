"""The memory of every grammar's mask table (table.py) together, bounded.

A table is ~1 KB per interned state and lives as long as its compiled grammar (the
backend's LRU keeps 256): without a bound the tables of many grammars used hard could
add up to gigabytes. Tables report their bytes here as they grow; before a walk, when the
total is past TOTAL_BYTES, tables are emptied, the least recently walked first, until it is
under LOW_BYTES (a table another thread is walking is skipped: its lock is held).
Emptying a table costs only speed (it refills on demand); masks are unchanged.

A walk runs where its mask is needed (the scheduler's thread, between decode steps), and
emptying a table frees its states (0.1-0.7 ms a table), so one walk empties tables for at
most EVICT_S (one table at least); the next walks go on from there down to LOW_BYTES
(the tables grow by a walk's few new states in between). Emptying 64 MB at once took 17-56 ms.
"""
from __future__ import annotations

import itertools
import threading
import time
import weakref

TOTAL_BYTES = 256 << 20  # all grammars' tables together
LOW_BYTES = 192 << 20    # what an eviction brings the total down to
EVICT_S = 0.002          # one walk's time for emptying others' tables (at least one is emptied)


class TableBudget:
    """Bytes held by live tables (each registered with `track`)."""

    def __init__(self, total: int = TOTAL_BYTES, low: int = LOW_BYTES, evict_s: float = EVICT_S):
        self.total, self.low, self.evict_s = total, low, evict_s
        self.used = 0
        self._lock = threading.Lock()
        self._tables: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # table -> last walk
        self._clock = itertools.count()
        self._returned: list = []  # bytes of collected tables, not counted yet (`give_back`)
        self._draining = False  # an eviction stopped at EVICT_S: walks go on with it down to low
        self._emptied: "weakref.WeakSet" = weakref.WeakSet()  # emptied, not walked since (nothing to free)

    def track(self, table) -> None:
        with self._lock:
            self._tables[table] = next(self._clock)

    def resize(self, delta: int) -> None:
        """A table's bytes changed by `delta`."""
        with self._lock:
            self.used += delta
            self._count_returned()

    def give_back(self, nbytes: int) -> None:
        """A collected table's bytes (its finalizer's call). Takes no lock: the collector runs
        finalizers at any allocation, on any thread, also inside this object's critical
        sections (a lock taken here would wait on its own thread: a grammar thread stuck for
        good). list.append is atomic; the next resize or walk counts them."""
        self._returned.append(nbytes)

    def _count_returned(self) -> None:
        returned = self._returned
        while returned:
            self.used -= returned.pop()

    def before_walk(self, table) -> None:
        """Called with `table`'s own walk lock held: marks it walked; evicts past the total."""
        with self._lock:
            self._count_returned()
            self._tables[table] = next(self._clock)
            self._emptied.discard(table)
            if self.used <= self.total and not (self._draining and self.used > self.low):
                self._draining = False
                return
            order = sorted(self._tables.items(), key=lambda kv: kv[1])
        deadline = time.perf_counter() + self.evict_s
        for other, _ in order:  # least recently walked first; the walker's own table last
            if self.used <= self.low:
                return
            if other is table or other in self._emptied:
                continue
            if other.lock.acquire(blocking=False):
                try:
                    other.reset()
                finally:
                    other.lock.release()
                self._emptied.add(other)
                if time.perf_counter() > deadline:
                    self._draining = self.used > self.low  # (the next walks go on down to low)
                    return
        self._draining = False
        if self.used > self.low:
            table.reset()


BUDGET = TableBudget()
