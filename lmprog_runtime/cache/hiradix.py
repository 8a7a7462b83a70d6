"""HiRadixCache: the radix tree over three KV tiers, L1 (device pool), L2 (host pool) and
L3 (storage, addressed by page hash).

A node's `value` holds its device slots or is None (evicted); its `host_value` holds host
slots or is None (not backed up). A node with neither is *storage-only*: its KV lives in
L3 pages only (it was written through to storage and then evicted from L2). Invariants,
on top of RadixCache's (audited by `check_integrity`):

- Every node has a device or a host copy, or is storage-only (only with an L3 attached).
- Residency is prefix-closed per tier: an evicted node's children are evicted, a
  storage-only node's children are storage-only. So a match is a device part, then a
  host part, then a storage part.
- Evicted nodes are never locked; `evictable_size`/`protected_size` count device tokens.
- `host_total_size()` = tokens of nodes with a host copy; no host slot is held twice.
- `storage_total_size()` = tokens of storage-only nodes, at most `l3.max_tokens`.
- `host_ref` pins a host-only node while a load-back allocates device room.

When copies happen (`write_policy`, SGLang's): `write_through` backs a node up to L2 at
its first insert (hit count 1), `write_through_selective` at its second (re-used nodes
only), `write_back` only when L1 evicts it. A node is backed up only after its parent
(parents first along the inserted path). `on_backup(node)` is called after each backup
(the controller writes L3 pages from it).

Eviction in LRU order on each tier: L1 evicts device leaves (resident nodes without
resident children): a backed-up one just drops its device slots and stays on L2; one
without a host copy is backed up first if it has host-only children or the policy is
write_back, and deleted (with its host-only subtree) when that is impossible. L2 evicts
host-only nodes without host-resident children: with an L3 attached (`l3`, an `L3Index`)
one whose whole L3 pages were written becomes storage-only (its tail past the last whole
page is deleted), else it is deleted with its storage-only subtree. Storage-only leaves
are deleted LRU first when there are more than `l3.max_tokens` of them. The tree's L3
part is a hint: storage is the truth (its LRU may drop pages), so a prefetch probes it
and `drop_storage_after` prunes what it no longer holds. `match_prefix` returns device
indices plus the host and storage parts' lengths; `load_back` copies the host part to
fresh device slots (all or nothing); a prefetch fills storage-only nodes with host slots
(`insert_host`).
"""

from __future__ import annotations

from typing import Callable, Hashable, List, NamedTuple, Optional, Sequence

import torch

from lmprog_runtime.cache.radix import KVIntegrityError, RadixCache, TreeNode
from lmprog_runtime.cache.storage.base import page_hashes

WRITE_THRESHOLDS = {"write_through": 1, "write_through_selective": 2, "write_back": None}


class HiMatchResult(NamedTuple):
    indices: torch.Tensor      # int64 [device tokens], a fresh tensor
    last_node: TreeNode        # deepest device-resident matched node (root when none)
    host_len: int              # tokens matched after it, on the host tier only
    last_host_node: TreeNode   # deepest host-or-device matched node (== last_node when host_len == 0)
    storage_len: int = 0       # tokens matched after that, in storage-only nodes (L3 by hash)


class L3Index(NamedTuple):
    """What the tree needs to know of the storage tier (set by the HiCache controller)."""
    page_tokens: int                       # an L3 page, a multiple of the KV page size
    stored: Callable[[List[str]], bool]    # were all these page keys written to storage?
    max_tokens: int                        # storage-only tokens the tree may remember


def _storage_only(n: TreeNode) -> bool:
    return n.value is None and n.host_value is None


class HiRadixCache(RadixCache):
    def __init__(self, allocator, host_allocator, io, page_size: int = 1,
                 write_policy: str = "write_through", on_backup: Optional[Callable] = None):
        if write_policy not in WRITE_THRESHOLDS:
            raise ValueError(f"write_policy must be one of {list(WRITE_THRESHOLDS)}, got {write_policy!r}")
        if host_allocator.page_size != page_size:
            raise ValueError(f"host page_size {host_allocator.page_size} != device page_size {page_size}")
        self.host_allocator = host_allocator
        self.io = io  # TierIO
        self.write_policy = write_policy
        self.write_threshold = WRITE_THRESHOLDS[write_policy]
        self.on_backup = on_backup
        self.l3: Optional[L3Index] = None
        self._host_tokens = 0
        self._storage_tokens = 0
        self.storage_counts = {"demoted": 0, "filled": 0}  # tokens made storage-only / filled back
        self.root = None
        super().__init__(allocator, page_size=page_size)

    # ------------------------------------------------------------------ sizes
    def host_total_size(self) -> int:
        return self._host_tokens

    def storage_total_size(self) -> int:
        return self._storage_tokens

    def reset(self) -> None:
        if self.root is not None:
            if self._protected:
                raise KVIntegrityError(f"reset with {self._protected} tokens locked")
            for node in self._nodes():
                if node.value is not None:
                    self.allocator.free(node.value)
                if node.host_value is not None:
                    self.host_allocator.free(node.host_value)
            self.root = None  # the base reset frees nothing more
        super().reset()
        self._host_tokens = 0
        self._storage_tokens = 0

    # ------------------------------------------------------------ match/insert
    def match_prefix(self, token_ids: Sequence[int], namespace: Hashable = None) -> HiMatchResult:
        key = self._aligned_key(token_ids)
        if not key:
            return HiMatchResult(self._empty(), self.root, 0, self.root)
        _, _, path = self._descend(key, namespace)
        device = [n for n in path if not n.evicted]  # a prefix of `path` (residency is prefix-closed)
        cached = [n for n in path if not _storage_only(n)]  # also a prefix, longer
        last = device[-1] if device else self.root
        host_len = sum(len(n.key) for n in cached[len(device):])
        storage_len = sum(len(n.key) for n in path[len(cached):])
        indices = torch.cat([n.value for n in device]) if device else self._empty()
        return HiMatchResult(indices, last, host_len, cached[-1] if cached else self.root, storage_len)

    def insert(self, token_ids: Sequence[int], kv_indices: torch.Tensor,
               namespace: Hashable = None) -> int:
        """As RadixCache.insert; evicted nodes on the path take the caller's slots (it
        computed them again), so the return value is the *device-resident* matched length."""
        key = self._aligned_key(token_ids)
        if len(kv_indices) < len(key):
            raise ValueError(f"insert: expected at least {len(key)} KV indices for the "
                             f"page-aligned tokens, got {len(kv_indices)}")
        if not key:
            return 0
        node, matched, path = self._descend(key, namespace)
        resident, pos = 0, 0
        for n in path:
            if n.evicted:
                if _storage_only(n):
                    self._storage_tokens -= len(n.key)
                n.value = kv_indices[pos:pos + len(n.key)].to(torch.int64).clone()
                self._evictable += len(n.key)  # evicted nodes are unlocked
            else:
                resident = pos + len(n.key)
            pos += len(n.key)
        if matched < len(key):
            value = kv_indices[matched:len(key)].to(torch.int64).clone()
            leaf = TreeNode(key[matched:], value, node, namespace, self._clock)
            node.children[self._child_key(leaf)] = leaf
            self._evictable += len(leaf.key)
            path.append(leaf)
        for n in path:
            n.hit_count += 1
        self._write_through(path)
        return resident

    def insert_host(self, token_ids: Sequence[int], start: int, host_slots: torch.Tensor,
                    namespace: Hashable = None) -> int:
        """Attach host KV for positions [start, start + len(host_slots)) of `token_ids`
        (page-aligned): storage-only nodes on the path take their slots, a new host-only
        leaf the rest. Returns `k`: the tree took `host_slots[k:]`, the caller frees
        `host_slots[:k]` (already cached, or all of them when the path to `start` is gone
        or a storage-only node begins before `start`)."""
        key = self._aligned_key(token_ids[:start + len(host_slots)])
        assert len(key) == start + len(host_slots), (len(key), start, len(host_slots))
        node, matched, path = self._descend(key, namespace)
        pos, first = 0, None  # first: where the storage-only part of the path begins
        for n in path:
            if first is None and _storage_only(n):
                first = pos
            pos += len(n.key)
        begin = matched if first is None else first
        if begin < start or begin >= len(key):
            return len(host_slots)
        pos = 0
        for n in path:
            if pos >= begin:
                n.host_value = host_slots[pos - start:pos - start + len(n.key)].to(torch.int64).clone()
                self._host_tokens += len(n.key)
                self._storage_tokens -= len(n.key)
                self.storage_counts["filled"] += len(n.key)
            pos += len(n.key)
        if matched < len(key):
            leaf = TreeNode(key[matched:], None, node, namespace, self._clock)
            leaf.host_value = host_slots[matched - start:].to(torch.int64).clone()
            node.children[self._child_key(leaf)] = leaf
            self._host_tokens += len(leaf.key)
        return begin - start

    # ------------------------------------------------------------ host copies
    def _write_through(self, path: List[TreeNode]) -> None:
        if self.write_threshold is None:
            return
        for n in path:  # root → leaf: a parent is backed up before its child
            if n.host_value is not None:
                continue
            if n.hit_count < self.write_threshold:
                return
            if not (n.parent is self.root or n.parent.host_value is not None) or not self._backup(n):
                return

    def _backup(self, node: TreeNode) -> bool:
        """Copy a resident node to the host tier; False when L2 has no room."""
        slots = self.alloc_host(len(node.key))
        if slots is None:
            return False
        self.io.device_to_host(node.value, slots)
        node.host_value = slots
        self._host_tokens += len(node.key)
        if self.on_backup is not None:
            self.on_backup(node)
        return True

    def _backup_chain(self, node: TreeNode) -> bool:
        """Back up `node` and, first, every ancestor without a host copy (they stay resident)."""
        for n in self.path_between(self.root, node):
            if n.host_value is None and not self._backup(n):
                return False
        return True

    def alloc_host(self, num_tokens: int) -> Optional[torch.Tensor]:
        """Host slots, evicting host-only leaves (LRU) when short; None if impossible."""
        slots = self.host_allocator.alloc(num_tokens)
        if slots is None:
            self.evict_host(num_tokens - self.host_allocator.available_size())
            slots = self.host_allocator.alloc(num_tokens)
        return slots

    def load_back(self, match: HiMatchResult, alloc: Callable[[int], Optional[torch.Tensor]]
                  ) -> Optional[HiMatchResult]:
        """Copy `match`'s host part into device slots from `alloc(n)` (which may evict);
        returns the match as if it were all on the device, or None (nothing changed)."""
        path = self.path_between(match.last_node, match.last_host_node)
        self.inc_lock_ref(match.last_node)  # the device part survives the eviction alloc may do
        for n in path:
            n.host_ref += 1
        try:
            dev = alloc(match.host_len)
        finally:
            for n in path:
                n.host_ref -= 1
            self.dec_lock_ref(match.last_node)
        if dev is None:
            return None
        self.io.host_to_device(torch.cat([n.host_value for n in path]), dev)
        pos = 0
        for n in path:
            n.value = dev[pos:pos + len(n.key)].clone()
            self._evictable += len(n.key)
            pos += len(n.key)
        node = match.last_host_node
        return HiMatchResult(torch.cat([match.indices, dev]), node, 0, node)

    def path_between(self, top: TreeNode, bottom: TreeNode) -> List[TreeNode]:
        """Nodes below `top` down to `bottom` (inclusive), top first."""
        path = []
        while bottom is not top:
            path.append(bottom)
            bottom = bottom.parent
        return path[::-1]

    # --------------------------------------------------------------- eviction
    def _device_leaf(self, n: TreeNode) -> bool:
        return not n.evicted and n.lock_ref == 0 and all(c.evicted for c in n.children.values())

    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` device tokens (LRU device leaves) if that many are evictable."""
        return self._evict_lru(num_tokens, self._device_leaf, self._evict_device)

    def _evict_device(self, node: TreeNode) -> int:
        n = len(node.key)
        if node.host_value is None and (self.write_threshold is None or node.children):
            self._backup_chain(node)  # write_back, or host-only children to keep reachable
        if node.host_value is None:
            self._delete_subtree(node)
            return n
        self.allocator.free(node.value)
        node.value = None
        self._evictable -= n
        return n

    def evict_host(self, num_tokens: int) -> int:
        """Free at least `num_tokens` host tokens, LRU first: host-only nodes without
        host-resident children become storage-only (`_demote`) or are deleted."""
        freed = self._evict_lru(num_tokens, self._host_leaf, self._evict_host_node)
        self._trim_storage()
        return freed

    def _host_leaf(self, n: TreeNode) -> bool:
        return (n.evicted and n.host_value is not None and n.host_ref == 0
                and all(c.host_value is None for c in n.children.values()))

    def _evict_host_node(self, node: TreeNode) -> int:
        n = len(node.key)
        if not self._demote(node):
            self._delete_subtree(node)
        return n

    def _demote(self, node: TreeNode) -> bool:
        """Drop `node`'s host copy and keep it as storage-only, when its L3 pages were
        written; a leaf first loses its tail past the last whole L3 page. False: no L3,
        or nothing of it is in storage (the caller deletes it)."""
        if self.l3 is None:
            return False
        S = self.l3.page_tokens
        path = self.path_between(self.root, node)
        end = sum(len(x.key) for x in path)
        begin = end - len(node.key)
        cut = end if node.children else end - end % S  # children: their pages hold our tail
        if cut <= begin:
            return False
        tokens = [t for x in path for t in x.key][:cut]
        if not self.l3.stored(page_hashes(tokens, S, node.namespace)[begin // S:]):
            return False
        if cut < end:
            tail, node = node, self._split(node, cut - begin)  # the prefix keeps the pages
            self._delete_leaf(tail)
        self.host_allocator.free(node.host_value)
        node.host_value = None
        self._host_tokens -= len(node.key)
        self._storage_tokens += len(node.key)
        self.storage_counts["demoted"] += len(node.key)
        return True

    def _trim_storage(self) -> None:
        """Forget storage-only leaves, LRU first, past `l3.max_tokens`."""
        if self.l3 is not None and self._storage_tokens > self.l3.max_tokens:
            self._evict_lru(self._storage_tokens - self.l3.max_tokens,
                            lambda n: _storage_only(n) and not n.children, self._delete_leaf)

    def drop_storage_only(self) -> None:
        """Forget every storage-only node (the storage tier is detached)."""
        tops = [n for n in self._nodes()
                if _storage_only(n) and (n.parent is self.root or not _storage_only(n.parent))]
        for n in tops:
            self._delete_subtree(n)

    def drop_storage_after(self, token_ids: Sequence[int], namespace: Hashable, keep: int) -> int:
        """Storage holds `token_ids`' pages only up to position `keep`: delete the
        storage-only nodes of the path that reach past it (with their subtrees)."""
        key = self._aligned_key(token_ids)
        if not key:
            return 0
        _, _, path = self._descend(key, namespace)
        pos = 0
        for n in path:
            pos += len(n.key)
            if _storage_only(n) and pos > keep:
                before = self._storage_tokens
                self._delete_subtree(n)
                return before - self._storage_tokens
        return 0

    def _delete_subtree(self, node: TreeNode) -> None:
        order, stack = [], [node]
        while stack:
            x = stack.pop()
            order.append(x)
            stack.extend(x.children.values())
        for x in reversed(order):  # descendants before their ancestors
            self._delete_leaf(x)

    def _delete_leaf(self, leaf: TreeNode) -> int:
        n = len(leaf.key)
        if leaf.host_ref or leaf.lock_ref:
            raise KVIntegrityError(f"deleting a pinned or locked node {leaf!r}")
        if leaf.value is not None:
            self.allocator.free(leaf.value)
            self._evictable -= n
        if leaf.host_value is not None:
            self.host_allocator.free(leaf.host_value)
            self._host_tokens -= n
        elif leaf.value is None:
            self._storage_tokens -= n
        del leaf.parent.children[self._child_key(leaf)]
        leaf.parent = None
        return n

    # -------------------------------------------------------------- auditing
    def _check_evicted(self, node: TreeNode) -> None:
        if node.lock_ref or (node.host_value is None and self.l3 is None):
            raise KVIntegrityError(f"{node!r}: evicted but locked, or without a copy on L2 or L3")

    def check_integrity(self) -> None:
        super().check_integrity()
        host, stored, slots = 0, 0, []
        for node in self._nodes():
            if node.evicted and any(not c.evicted for c in node.children.values()):
                raise KVIntegrityError(f"{node!r}: evicted with a device-resident child")
            if node.host_ref:
                raise KVIntegrityError(f"{node!r}: host pin left behind")
            if node.host_value is None:
                if node.value is None:
                    stored += len(node.key)
                    if any(c.host_value is not None for c in node.children.values()):
                        raise KVIntegrityError(f"{node!r}: storage-only with a host-resident child")
                continue
            if not (node.host_value.dtype == torch.int64 and tuple(node.host_value.shape) == (len(node.key),)):
                raise KVIntegrityError(f"{node!r}: host value shape {tuple(node.host_value.shape)}")
            host += len(node.key)
            slots.append(node.host_value)
        if (host, stored) != (self._host_tokens, self._storage_tokens):
            raise KVIntegrityError(f"host / storage-only tokens: counted {host} / {stored}, counters say "
                                   f"{self._host_tokens} / {self._storage_tokens}")
        if self.l3 is not None and stored > self.l3.max_tokens:
            raise KVIntegrityError(f"{stored} storage-only tokens, more than the limit {self.l3.max_tokens}")
        if slots:
            every = torch.cat(slots)
            if torch.unique(every).numel() != every.numel():
                raise KVIntegrityError("a host KV slot is held twice")
