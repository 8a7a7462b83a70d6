"""HiCacheController: what KVManager asks of the lower tiers, and their metrics.

    prefetch(req)       start an L3 → L2 read for a request entering the queue
    ready(req)          may it be scheduled (the prefetch stop policy decides)
    should_load(n)      load n host tokens back, or recompute them (the cost model)
    on_backup(node)     a node reached L2: write its whole pages to L3 (background)
    host_held()         host slots held outside the tree (by prefetches), for the audit

Load-back pays only where copying beats recomputing: loading n tokens costs
`n * bytes_per_token / load_bytes_per_s` (host → device bandwidth, measured at start-up
by TierIO.calibrate), recomputing costs `n / prefill_tokens_per_s` (measured on the
prefill steps served so far; until the first one, load-back is assumed cheaper). Below
MIN_LOAD_BACK_TOKENS (SGLang's 10) it always recomputes. Decisions and inputs are in
`stats` (→ internal state → /metrics).
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from typing import Optional

import torch

from lmprog_runtime.cache.hiradix import L3Index
from lmprog_runtime.cache.prefetch import Prefetcher
from lmprog_runtime.cache.storage.base import page_hashes

logger = logging.getLogger(__name__)

MIN_LOAD_BACK_TOKENS = 10
STORAGE_PAGE_MIN_TOKENS = 64   # L3 page: the KV page size rounded up to at least this many tokens
WRITTEN_KEYS_REMEMBERED = 1 << 16
STORAGE_TREE_HOST_MULTIPLE = 8  # storage-only tokens the tree remembers, x L2, when L3 has no known size
PREFILL_RATE_MIN_TOKENS = 64   # steps computing fewer prompt tokens do not measure the rate
PREFILL_RATE_SMOOTHING = 0.3   # weight of the newest measurement


@dataclass(frozen=True)
class HiCacheConfig:
    """`--hicache-storage-backend-extra-config` (JSON object, or `@path` to one); SGLang's keys
    and defaults, plus the mooncake backend's."""
    prefetch_threshold: int = 256             # tokens past the L1+L2 hit worth a prefetch
    prefetch_timeout_base: float = 2.0        # seconds
    prefetch_timeout_per_ki_token: float = 0.1
    prefetch_timeout_max: float = 30.0
    master_server_address: Optional[str] = None  # mooncake: host:port of mooncake_master
    metadata_server: Optional[str] = None        # mooncake: default P2PHANDSHAKE
    local_hostname: str = "127.0.0.1"           # mooncake: the address other servers reach us at
    device_name: str = ""                        # mooncake: RDMA device ("" for tcp)
    protocol: str = "tcp"
    global_segment_size: int = 256 * 1024 * 1024   # bytes this server lends the store
    local_buffer_size: int = 64 * 1024 * 1024

    @classmethod
    def parse(cls, text: Optional[str]) -> "HiCacheConfig":
        if not text:
            return cls()
        try:
            if text.startswith("@"):
                with open(text[1:]) as f:
                    text = f.read()
            raw = json.loads(text)
        except (OSError, ValueError) as e:
            raise ValueError(f"hicache_storage_backend_extra_config: expected a JSON object or "
                             f"@file.json, got {text[:80]!r} ({e})") from e
        if not isinstance(raw, dict):
            raise ValueError(f"hicache_storage_backend_extra_config: expected a JSON object, got {type(raw).__name__}")
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(raw) - set(known))
        if unknown:
            raise ValueError(f"hicache_storage_backend_extra_config: unknown key(s) {unknown}; "
                             f"expected some of {sorted(known)}")
        for k, v in raw.items():
            want = {"int": int, "float": (int, float), "str": str}.get(str(known[k].type), str)
            if v is not None and (not isinstance(v, want) or isinstance(v, bool)):
                raise ValueError(f"hicache_storage_backend_extra_config.{k}: expected {known[k].type}, "
                                 f"got {v!r}")
        return cls(**raw)


def _new_stats() -> dict:
    """Token counts, bytes, seconds; rates in units/s (0.0: not measured yet)."""
    return {"hicache_hit_tokens_l1": 0, "hicache_hit_tokens_l2": 0, "hicache_hit_tokens_l3": 0,
            "l3_write_bytes": 0, "l3_read_bytes": 0,
            "hicache_load_back_count": 0, "hicache_load_back_seconds_sum": 0.0,
            "hicache_prefetch_count": 0, "hicache_prefetch_seconds_sum": 0.0,
            "hicache_decisions_load": 0, "hicache_decisions_recompute": 0,
            "hicache_prefill_tokens_per_s": 0.0, "hicache_l2_load_bytes_per_s": 0.0,
            "hicache_l3_read_bytes_per_s": 0.0}


class HiCacheController:
    def __init__(self, tree, io, storage, page_tokens: int, prefetch_policy: str, config: HiCacheConfig):
        self.tree, self.io, self.storage = tree, io, None
        self.page_tokens = page_tokens  # L3 page, a multiple of the KV page size
        self.config = config
        self.prefetch_policy = prefetch_policy
        self.stats = _new_stats()
        self.stats["hicache_l2_load_bytes_per_s"] = io.load_bytes_per_s
        self.prefetcher = None
        self._writer = None
        self._written: "OrderedDict[str, None]" = OrderedDict()  # keys already sent to L3 (bounded)
        self._writes_queued = 0  # batches given to the writer (this thread only writes it)
        self._writes_done = 0    # batches it finished (the writer thread only writes it)
        if storage is not None:
            self.attach(storage, prefetch_policy, config)

    # -- the storage tier (at start-up, or /hicache/storage-backend while idle) -----------------
    def attach(self, storage, prefetch_policy: str, config: HiCacheConfig) -> None:
        """Start using `storage` as L3: prefetches read from it, backups write to it."""
        assert self.storage is None, "detach the storage backend first"
        self.storage, self.prefetch_policy, self.config = storage, prefetch_policy, config
        self.prefetcher = Prefetcher(self.tree, self.io, storage, self.page_tokens, prefetch_policy,
                                     config, self.stats)
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="lmprog-hicache-write")
        self.tree.on_backup = self.on_backup
        capacity = storage.capacity_bytes()
        per_token = self.io.host_pool.bytes_per_token
        self.tree.l3 = L3Index(self.page_tokens, self._stored, capacity // per_token if capacity
                               else STORAGE_TREE_HOST_MULTIPLE * self.tree.host_allocator.size)

    def detach(self) -> None:
        """Stop using L3: prefetches end (their pages are kept), queued writes finish, the
        tree forgets its storage-only nodes; the pages stay in the backend."""
        if self.storage is None:
            return
        self.prefetcher.close()
        self._writer.shutdown(wait=True)
        self.tree.on_backup, self.tree.l3 = None, None
        self.tree.drop_storage_only()
        self._written.clear()
        storage, self.storage, self.prefetcher, self._writer = self.storage, None, None, None
        storage.close()

    # -- L3 → L2 ------------------------------------------------------------------------------
    def prefetch(self, rid: str, tokens, namespace) -> None:
        if self.prefetcher is not None:
            self.prefetcher.start(rid, tokens, namespace)

    def ready(self, rid: str) -> bool:
        return self.prefetcher is None or self.prefetcher.ready(rid)

    def forget(self, rid: str) -> None:
        if self.prefetcher is not None:
            self.prefetcher.forget(rid)

    def prefetching(self) -> bool:
        return self.prefetcher is not None and bool(self.prefetcher.tasks)

    def wait_prefetch(self, timeout_s: float) -> None:
        if self.prefetcher is not None:
            self.prefetcher.wait_any(timeout_s)

    def take_from_storage(self, rid: str) -> int:
        return 0 if self.prefetcher is None else self.prefetcher.take_from_storage(rid)

    def host_held(self) -> int:
        return 0 if self.prefetcher is None else self.prefetcher.held()

    # -- L2 → L1 ------------------------------------------------------------------------------
    def should_load(self, num_tokens: int) -> bool:
        s = self.stats
        load = num_tokens >= MIN_LOAD_BACK_TOKENS
        rate, bw = s["hicache_prefill_tokens_per_s"], self.io.load_bytes_per_s
        if load and rate > 0 and bw > 0:
            load = num_tokens * self.io.host_pool.bytes_per_token / bw < num_tokens / rate
        s["hicache_decisions_load" if load else "hicache_decisions_recompute"] += 1
        return load

    def observe_load(self, seconds: float) -> None:
        self.stats["hicache_load_back_count"] += 1
        self.stats["hicache_load_back_seconds_sum"] += seconds

    def observe_prefill(self, prompt_tokens: int, seconds: float) -> None:
        """One forward that computed `prompt_tokens` prompt tokens in `seconds`."""
        if prompt_tokens < PREFILL_RATE_MIN_TOKENS or seconds <= 0:
            return
        rate, old = prompt_tokens / seconds, self.stats["hicache_prefill_tokens_per_s"]
        self.stats["hicache_prefill_tokens_per_s"] = rate if old == 0 else (
            PREFILL_RATE_SMOOTHING * rate + (1 - PREFILL_RATE_SMOOTHING) * old)

    # -- L2 → L3 ------------------------------------------------------------------------------
    def on_backup(self, node) -> None:
        """`node` now has host slots: the L3 pages ending inside it whose every token is on
        the host go to storage (their bytes copied now; written on the writer thread)."""
        path = self.tree.path_between(self.tree.root, node)
        end = sum(len(n.key) for n in path)
        begin = end - len(node.key)
        S = self.page_tokens
        first, last = begin // S, end // S
        if last <= first or any(n.host_value is None for n in path):
            return
        tokens = [t for n in path for t in n.key]
        host = torch.cat([n.host_value for n in path])
        keys, values = [], []
        for i, key in enumerate(page_hashes(tokens[:last * S], S, node.namespace)[first:], first):
            if key in self._written:
                self._written.move_to_end(key)
                continue
            keys.append(key)
            values.append(self.io.page_bytes(host[i * S:(i + 1) * S]))
            self._remember(key)
        if keys:
            self.stats["l3_write_bytes"] += sum(len(v) for v in values)
            self._writes_queued += 1
            self._writer.submit(self._write, keys, values)

    def _stored(self, keys) -> bool:
        """Were all `keys` sent to storage (as far as the bounded memory of writes knows)?"""
        return all(k in self._written for k in keys)

    def _remember(self, key: str) -> None:
        self._written[key] = None
        if len(self._written) > WRITTEN_KEYS_REMEMBERED:
            self._written.popitem(last=False)

    def _write(self, keys, values) -> None:
        """Writer thread: one batch of pages; a failure is logged (the pages are just not on L3)."""
        try:
            ok = self.storage.batch_set(keys, values)
            if not all(ok):
                logger.warning("hicache: %d of %d pages not stored", len(ok) - sum(ok), len(ok))
        except Exception:  # noqa: BLE001 - a storage failure loses cache, never requests
            logger.exception("hicache: writing %d pages to storage failed", len(keys))
        finally:
            self._writes_done += 1

    def drain_writes(self) -> None:
        """Block until every queued L3 write has run (tests, shutdown)."""
        if self._writer is not None:
            self._writer.submit(lambda: None).result()

    def flush(self) -> None:
        self.io.drain()
        if self.prefetcher is not None:
            for rid in list(self.prefetcher.tasks):
                self.prefetcher.finish(rid, keep=False)
        self._written.clear()

    def close(self) -> None:
        self.detach()
        self.io.close()

    def state(self) -> dict:
        s = dict(self.stats)
        s.update({k: v for k, v in self.io.stats.items()})
        s["hicache_l2_load_bytes_per_s"] = self.io.load_bytes_per_s
        s["hicache_layerwise_copy_seconds_sum"] = self.io.loads.copy_seconds if self.io.loads else 0.0
        s["hicache_host_tokens"] = self.tree.host_total_size()
        s["hicache_storage_tree_tokens"] = self.tree.storage_total_size()
        s["hicache_storage_demoted_tokens"] = self.tree.storage_counts["demoted"]
        s["hicache_storage_filled_tokens"] = self.tree.storage_counts["filled"]
        s["hicache_host_pool_tokens"] = self.tree.host_allocator.size
        s["hicache_l3_writes_pending"] = self._writes_queued - self._writes_done
        return s
