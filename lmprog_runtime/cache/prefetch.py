"""L3 → L2 prefetch: a waiting request's pages are read from storage into host slots on
a background thread while the request waits in the queue.

The scheduler thread owns every decision: it checks which pages exist, allocates the
host slots (so the host tier's accounting stays exact: those slots are `held()` by the
prefetch until it ends), and at the end inserts the pages read so far into the tree as
host-only nodes and frees the rest. The worker only reads pages and fills the slots it
was given, one batch at a time, checking `cancel` between batches; `done_pages` only
grows.

When a prefetching request may be scheduled (`ready`), SGLang's stop policies:
    best_effort     stop now and keep what arrived
    wait_complete   wait until every page arrived
    timeout         wait until done or `min(max, base + per_ki_token * tokens / 1024)` s
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Dict, Hashable, List

import torch

logger = logging.getLogger(__name__)

PAGES_PER_READ = 8  # pages per batch_get; the cancel granularity


@dataclass
class PrefetchTask:
    rid: str
    tokens: List[int]          # the request's tokens up to the last prefetched page
    namespace: Hashable
    start: int                 # first position read (a multiple of the storage page)
    keys: List[str]            # page keys from `start`, all present when checked
    host_slots: torch.Tensor   # int64 [len(keys) * page_tokens]
    timeout_s: float
    started: float = field(default_factory=time.monotonic)
    cancel: threading.Event = field(default_factory=threading.Event)
    done_pages: int = 0        # written by the worker only
    future: object = None


class Prefetcher:
    def __init__(self, tree, io, storage, page_tokens: int, policy: str, config, stats: dict):
        self.tree, self.io, self.storage = tree, io, storage
        self.page_tokens = page_tokens
        self.policy = policy
        self.config = config   # HiCacheConfig: threshold and timeout parameters
        self.stats = stats
        self.tasks: Dict[str, PrefetchTask] = {}
        self.from_storage: Dict[str, int] = {}  # rid -> tokens its prefetch put on L2
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="lmprog-hicache-prefetch")

    def held(self) -> int:
        return sum(len(t.host_slots) for t in self.tasks.values())

    def futures(self) -> list:
        return [t.future for t in self.tasks.values()]

    # -- start ------------------------------------------------------------------------------
    def start(self, rid: str, tokens: List[int], namespace: Hashable) -> bool:
        """Begin reading the stored pages after what the tree holds; False when none are worth it."""
        S = self.page_tokens
        m = self.tree.match_prefix(tokens, namespace)
        have = len(m.indices) + m.host_len
        first, last = have // S, len(tokens) // S
        if rid in self.tasks or len(tokens) - have < self.config.prefetch_threshold or last <= first:
            return False
        try:
            keys = self._present_keys(tokens[:last * S], namespace, first)
        except Exception:  # noqa: BLE001 - a storage that cannot answer just means no prefetch
            logger.exception("hicache: storage lookup for %s failed", rid)
            return False
        found = (first + len(keys)) * S
        if m.storage_len and found < min(have + m.storage_len, len(tokens)) // S * S:
            self.tree.drop_storage_after(tokens, namespace, found)  # storage lost pages the tree knew
        if not keys:
            return False
        slots = self.tree.alloc_host(len(keys) * S)
        if slots is None:
            return False
        n = len(keys) * S
        timeout = min(self.config.prefetch_timeout_max,
                      self.config.prefetch_timeout_base + self.config.prefetch_timeout_per_ki_token * n / 1024)
        task = PrefetchTask(rid, list(tokens[:first * S + n]), namespace, first * S, keys, slots, timeout)
        task.future = self._pool.submit(self._read, task)
        self.tasks[rid] = task
        return True

    def _present_keys(self, tokens: List[int], namespace: Hashable, first: int) -> List[str]:
        from lmprog_runtime.cache.storage import page_hashes
        keys = page_hashes(tokens, self.page_tokens, namespace)[first:]
        return keys[:self.storage.batch_exists(keys)]

    def _read(self, task: PrefetchTask) -> None:
        """Worker thread: fill the task's slots page by page until done, cancelled or a miss;
        a storage error ends the prefetch where it got (the request recomputes the rest)."""
        try:
            self._read_pages(task)
        except Exception:  # noqa: BLE001 - storage trouble must not reach the scheduler
            logger.exception("hicache prefetch of %s stopped after %d pages", task.rid, task.done_pages)

    def _read_pages(self, task: PrefetchTask) -> None:
        S, want = self.page_tokens, self.io.page_nbytes(self.page_tokens)
        for b in range(0, len(task.keys), PAGES_PER_READ):
            if task.cancel.is_set():
                return
            for i, data in enumerate(self.storage.batch_get(task.keys[b:b + PAGES_PER_READ]), b):
                if data is None or len(data) != want:  # gone (LRU) or torn: the chain stops here
                    return
                self.io.write_page(task.host_slots[i * S:(i + 1) * S], data)
                task.done_pages = i + 1

    # -- end --------------------------------------------------------------------------------
    def ready(self, rid: str) -> bool:
        """May the request be scheduled now? Ends its prefetch when the policy says so."""
        task = self.tasks.get(rid)
        if task is None:
            return True
        if not task.future.done():
            if self.policy == "wait_complete":
                return False
            if self.policy == "timeout" and time.monotonic() - task.started < task.timeout_s:
                return False
        self.finish(rid)
        return True

    def finish(self, rid: str, keep: bool = True) -> None:
        """Stop `rid`'s prefetch (waiting for the page batch in flight) and settle its slots:
        the pages read go into the tree when `keep`, the rest are freed."""
        task = self.tasks.pop(rid, None)
        if task is None:
            return
        task.cancel.set()
        task.future.result()
        self._record(task)
        n = task.done_pages * self.page_tokens
        got, rest = task.host_slots[:n], task.host_slots[n:]
        self.tree.host_allocator.free(rest)
        if n == 0:
            return
        if not keep:
            self.tree.host_allocator.free(got)
            return
        k = self.tree.insert_host(task.tokens[:task.start + n], task.start, got, task.namespace)
        self.tree.host_allocator.free(got[:k])
        if n > k:
            self.from_storage[rid] = n - k

    def _record(self, task: PrefetchTask) -> None:
        s, elapsed = self.stats, time.monotonic() - task.started
        nbytes = task.done_pages * self.io.page_nbytes(self.page_tokens)
        s["hicache_prefetch_count"] += 1
        s["hicache_prefetch_seconds_sum"] += elapsed
        s["l3_read_bytes"] += nbytes
        if nbytes and elapsed > 0:
            s["hicache_l3_read_bytes_per_s"] = nbytes / elapsed

    def wait_any(self, timeout_s: float) -> None:
        """Block up to `timeout_s` for some prefetch to finish (the scheduler has nothing else to do)."""
        futures = [f for f in self.futures() if not f.done()]
        if futures:
            wait(futures, timeout=timeout_s, return_when="FIRST_COMPLETED")

    def take_from_storage(self, rid: str) -> int:
        return self.from_storage.pop(rid, 0)

    def forget(self, rid: str) -> None:
        """The request left the queue without being scheduled (e.g. aborted)."""
        self.finish(rid, keep=True)
        self.from_storage.pop(rid, None)

    def close(self) -> None:
        for rid in list(self.tasks):
            self.finish(rid, keep=False)
        self._pool.shutdown(wait=True)
