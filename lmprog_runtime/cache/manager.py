"""KVManager: who owns which KV slot, between requests, the allocator and the radix tree.

Every move of KV ownership goes through here, and only here are a request's KV fields
(`row`, `kv_len`, `cache_protected_len`, `last_node`) written:

    assign            a row + the cached prefix, locked          (admission)
    alloc_extend      fresh slots for the next n positions       (admission, each step)
    commit            those n positions are now computed         (after the forward)
    cache_unfinished  the computed prefix goes to the tree       (a prompt finished computing)
    truncate          drop KV past a position                    (rejected draft tokens)
    retract           give everything back, keep the tokens      (the pool ran short)
    release           hand the KV to the tree (or free it)       (the request finished)

Invariant (checked by `check_integrity` whenever the scheduler is idle and in tests):
    free pages + pages held by the tree + pages held by requests == all pages
where a request holds the pages of positions [cache_protected_len, kv_len) and the
tree holds (and, while the request runs, lock-protects) [0, cache_protected_len).

With HiCache (`hicache`, a HiCacheController; the tree is a HiRadixCache) the host tier
has the same invariant: free host pages + host pages of the tree + host pages held by
prefetches == all host pages. `assign` also loads the host-resident part of a match back
into the device pool (L2 → L1) when the controller says copying beats recomputing, and
records where the prefix came from in `req.tier_hits` (device, host, storage tokens).
"""

from __future__ import annotations

import time
from typing import Iterable, Optional

import torch

from lmprog_runtime.cache.allocator import TokenSlotAllocator
from lmprog_runtime.cache.kv_pool import ReqToTokenPool
from lmprog_runtime.cache.radix import KVIntegrityError


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class KVManager:
    def __init__(self, req_pool: ReqToTokenPool, allocator: TokenSlotAllocator, tree, hicache=None,
                 kv_pool=None):
        self.req_pool = req_pool
        self.kv_pool = kv_pool  # TokenToKVPool: its data moves only for draft trees (keep_path)
        self.allocator = allocator
        self.tree = tree  # RadixCache (HiRadixCache with hicache); tree.disable means no sharing
        self.hicache = hicache
        self.page_size = allocator.page_size

    @property
    def cache_enabled(self) -> bool:
        return not self.tree.disable

    # -- admission ------------------------------------------------------------------------
    def match_len(self, req) -> int:
        """How many leading tokens of `req` the tree could serve now. Side effects: the
        match refreshes the LRU clock of the nodes it walks and may split a node where
        the match ends inside it (the tree's contents stay the same)."""
        if not self.cache_enabled:
            return 0
        match = self.tree.match_prefix(self._matchable(req), req.namespace)
        return len(match.indices) + getattr(match, "host_len", 0)

    def match_node(self, req):
        """The deepest tree node of `req`'s cached prefix (the root when nothing matches);
        None when the cache is off. Same side effects as `match_len`."""
        if not self.cache_enabled:
            return None
        return self.tree.match_prefix(self._matchable(req), req.namespace).last_node

    def _matchable(self, req):
        # Keep at least one token to compute (its logits start the output), and compute
        # every prompt position whose input logprob was asked for.
        limit = req.seq_len - 1
        if req.wants_input_logprobs:
            limit = min(limit, max(req.logprob_start_len - 1, 0))
        return req.fill_ids[:max(limit, 0)]

    def assign(self, req) -> bool:
        """Give `req` a row and its cached prefix (locked). False when no row is free."""
        assert req.row is None
        if self.req_pool.available_size() == 0:
            return False
        req.row = self.req_pool.alloc()
        if self.cache_enabled:
            match = self._match_and_load(req)
            n = len(match.indices)
            self.tree.inc_lock_ref(match.last_node)
            req.last_node = match.last_node
            if n:
                self.req_pool.table[req.row, :n] = match.indices
        else:
            n = 0
        req.kv_len = req.cache_protected_len = n
        return True

    def _match_and_load(self, req):
        """The tree's match for `req`, with its host part loaded into the device pool when
        that pays (else the request recomputes it); sets `req.tier_hits`."""
        match = self.tree.match_prefix(self._matchable(req), req.namespace)
        host_len = getattr(match, "host_len", 0)
        loaded = 0
        if host_len and self.hicache.should_load(host_len):
            t0 = time.perf_counter()
            done = self.tree.load_back(match, self._alloc)
            if done is not None:
                self.hicache.observe_load(time.perf_counter() - t0)
                match, loaded = done, host_len
        from_storage = min(loaded, self.hicache.take_from_storage(req.rid)) if self.hicache else 0
        req.tier_hits = (len(match.indices) - loaded, loaded - from_storage, from_storage)
        return match

    # -- L3 prefetch (HiCache with a storage backend) -----------------------------------------
    def prefetch(self, req) -> None:
        """`req` entered the waiting queue: start reading its stored pages into L2."""
        if self.hicache is not None:
            self.hicache.prefetch(req.rid, self._matchable(req), req.namespace)

    def storage_ready(self, req) -> bool:
        """May `req` be admitted now (its prefetch ended, or its stop policy ends it now)?"""
        return self.hicache is None or self.hicache.ready(req.rid)

    def forget_prefetch(self, req) -> None:
        if self.hicache is not None:
            self.hicache.forget(req.rid)

    def wait_for_storage(self, timeout_s: float) -> None:
        """Nothing to compute: block up to `timeout_s` while a queued request's prefetch runs."""
        if self.hicache is not None and self.hicache.prefetching():
            self.hicache.wait_prefetch(timeout_s)

    def observe_prefill(self, prompt_tokens: int, seconds: float) -> None:
        """A forward computed `prompt_tokens` prompt tokens in `seconds` (the prefill rate)."""
        if self.hicache is not None:
            self.hicache.observe_prefill(prompt_tokens, seconds)

    def count_tier_hits(self, req) -> None:
        """`req`'s first admission: add where its cached prefix came from to the metrics,
        and a hit to each tree node of that prefix."""
        if req.kv_len and req.last_node is not None:
            self.tree.record_hit(req.last_node)
        if self.hicache is not None:
            for tier, n in zip(("l1", "l2", "l3"), req.tier_hits):
                self.hicache.stats[f"hicache_hit_tokens_{tier}"] += n

    def close(self) -> None:
        if self.hicache is not None:
            self.hicache.close()

    def unassign(self, req) -> None:
        """Undo `assign` before anything was computed (admission found no room)."""
        assert req.kv_len == req.cache_protected_len, req
        self.release(req, cache=False)
        req.kv_len = req.cache_protected_len = 0

    # -- allocation -----------------------------------------------------------------------
    def available(self) -> int:
        return self.allocator.available_size() + (self.tree.evictable_size() if self.cache_enabled else 0)

    def pages_needed(self, kv_len: int, extend: int) -> int:
        return _ceil_div(kv_len + extend, self.page_size) - _ceil_div(kv_len, self.page_size)

    def alloc_extend(self, req, n: int) -> Optional[torch.Tensor]:
        """Slots for positions [kv_len, kv_len + n) of `req`, written into its row; None if full."""
        p = self.page_size
        new_pages = self.pages_needed(req.kv_len, n)
        fresh = self._alloc(new_pages * p)
        if fresh is None:
            return None
        row = self.req_pool.table[req.row]
        if p == 1:
            loc = fresh
        else:
            start = req.kv_len
            pos = torch.arange(start, start + n, dtype=torch.int64)
            partial = start % p != 0
            first_page = torch.div(row[start - 1], p, rounding_mode="floor").view(1) if partial else None
            fresh_pages = fresh.view(-1, p)[:, 0] // p
            pages = fresh_pages if first_page is None else torch.cat([first_page, fresh_pages])
            page_idx = pos // p - start // p
            loc = pages[page_idx] * p + pos % p
        row[req.kv_len:req.kv_len + n] = loc
        return loc

    def _alloc(self, num_tokens: int) -> Optional[torch.Tensor]:
        if num_tokens == 0:
            return torch.empty(0, dtype=torch.int64)
        slots = self.allocator.alloc(num_tokens)
        if slots is None and self.cache_enabled:
            self.tree.evict(num_tokens - self.allocator.available_size())
            slots = self.allocator.alloc(num_tokens)
        return slots

    def commit(self, req, n: int) -> None:
        """Positions [kv_len, kv_len + n), allocated by `alloc_extend`, are computed."""
        req.kv_len += n

    # -- release --------------------------------------------------------------------------
    def _free_positions(self, req, start: int, end: int) -> None:
        """Free the request-owned pages covering positions [start, end); start is page-aligned."""
        if end <= start:
            return
        assert start % self.page_size == 0, (start, self.page_size)
        self.allocator.free(self.req_pool.table[req.row, start:end].clone())

    def release(self, req, cache: bool = True) -> None:
        """The request is done with its KV: hand it to the tree (or free it) and drop the row."""
        if req.row is None:
            return
        if self.cache_enabled and cache:
            aligned = req.kv_len // self.page_size * self.page_size
            key = req.fill_ids[:aligned]
            indices = self.req_pool.table[req.row, :aligned].clone()
            present = self.tree.insert(key, indices, req.namespace)
            # [protected, present): our duplicates of what the tree already had.
            self._free_positions(req, req.cache_protected_len, present)
            self._free_positions(req, aligned, req.kv_len)
        else:
            self._free_positions(req, req.cache_protected_len, req.kv_len)
        if self.cache_enabled:
            self.tree.dec_lock_ref(req.last_node)
        self.req_pool.free(req.row)
        req.row = None
        req.last_node = None

    def retract(self, req, cache: bool = True) -> None:
        """Give back all of `req`'s KV (computed pages go to the tree unless `cache` is False,
        e.g. a failed forward's); its tokens stay, and the next admission recomputes what
        the tree no longer holds."""
        self.release(req, cache=cache)
        req.kv_len = req.cache_protected_len = 0

    def cache_unfinished(self, req) -> None:
        """Insert the computed part of a running request (e.g. after a prefill chunk)."""
        if not self.cache_enabled or req.row is None:
            return
        aligned = req.kv_len // self.page_size * self.page_size
        if aligned <= req.cache_protected_len:
            return
        key = req.fill_ids[:aligned]
        row = self.req_pool.table[req.row]
        present = self.tree.insert(key, row[:aligned].clone(), req.namespace)
        self._free_positions(req, req.cache_protected_len, present)
        match = self.tree.match_prefix(key, req.namespace)
        assert len(match.indices) == aligned, (len(match.indices), aligned)
        row[:aligned] = match.indices
        self.tree.inc_lock_ref(match.last_node)
        self.tree.dec_lock_ref(req.last_node)
        req.last_node = match.last_node
        req.cache_protected_len = aligned

    def keep_path(self, req, first: int, path) -> None:
        """A verified draft tree: node path[i]'s KV (position first + path[i] of the request)
        moves to position first + i, so the accepted tokens' KV lies in order after the root
        (positions then follow the pages as usual; `truncate` frees the rest). path[i] >= i and
        increasing, so each source is read before any copy writes it."""
        moves = [(first + j, first + i) for i, j in enumerate(path) if j != i]
        if not moves:
            return
        assert req.kv_len >= first + path[-1] + 1, (req.kv_len, first, path)
        row = self.req_pool.table[req.row]
        src = row[torch.tensor([m[0] for m in moves])]
        dst = row[torch.tensor([m[1] for m in moves])]
        self.kv_pool.move(src, dst)

    def truncate(self, req, new_kv_len: int) -> None:
        """Drop KV beyond `new_kv_len` (the verify step rejected those draft tokens)."""
        new_kv_len = max(new_kv_len, req.cache_protected_len)
        if new_kv_len >= req.kv_len:
            return
        first_free = _ceil_div(new_kv_len, self.page_size) * self.page_size
        self._free_positions(req, first_free, req.kv_len)
        req.kv_len = new_kv_len

    # -- audit ----------------------------------------------------------------------------
    def held_by(self, reqs: Iterable) -> int:
        p = self.page_size
        return sum((_ceil_div(r.kv_len, p) - r.cache_protected_len // p) * p for r in reqs if r.row is not None)

    def check_integrity(self, live_reqs: Iterable) -> None:
        tree_tokens = 0
        if self.cache_enabled:
            self.tree.check_integrity()
            tree_tokens = self.tree.total_size()
        free = self.allocator.available_size()
        held = self.held_by(live_reqs)
        total = self.allocator.size
        if free + tree_tokens + held != total:  # not an assert: `python -O` must not skip it
            raise KVIntegrityError(
                f"KV accounting broken: free {free} + tree {tree_tokens} + requests {held} != total {total}")
        if self.hicache is not None:
            self._check_host_tier()

    def _check_host_tier(self) -> None:
        host = self.tree.host_allocator
        free, cached, held = host.available_size(), self.tree.host_total_size(), self.hicache.host_held()
        if free + cached + held != host.size:
            raise KVIntegrityError(f"host KV accounting broken: free {free} + tree {cached} + "
                                   f"prefetches {held} != total {host.size}")

    def flush(self) -> None:
        if self.hicache is not None:
            self.hicache.flush()
        if self.cache_enabled:
            self.tree.reset()
        self.allocator.clear()
        if self.hicache is not None:
            self.tree.host_allocator.clear()
        self.req_pool.clear()
