"""RadixAttention prefix cache: a radix tree over token ids whose values are KV slots.

The tree owns the KV slots stored in its nodes and gives them back through
`allocator.free` when it evicts or resets. Invariants (audited by `check_integrity`):

- Every non-root node has a non-empty key (a tuple of token ids) whose length is a
  multiple of `page_size`, and a value: int64 `[len(key)]`, the KV slot of each token.
  No slot appears twice in the tree.
- A node's children are keyed by the first page of their key: `key[0]` when
  `page_size == 1`, else the tuple `key[:page_size]`. Under the root the page is
  wrapped as `(namespace, page)`, so each namespace is its own subtree and two
  namespaces never share a node.
- `lock_ref(node)` = locks taken on the node itself + the sum of its children's
  `lock_ref` (`inc_lock_ref` walks to the root). The root is always locked (1).
- `evictable_size()` = tokens in nodes with `lock_ref == 0`; `protected_size()` = the
  tokens of locked nodes; `total_size()` is their sum.
- `last_access_time` is a logical clock: one tick per `match_prefix`/`insert` call, set
  on every node of the walked path. A parent is therefore never older than its
  children, and LRU eviction of leaves never strands an older parent.

Splitting keeps the original node object as the *suffix* half, so a node handed out
by `match_prefix` (and locked by the scheduler) keeps ending at the same token.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Callable, Hashable, List, NamedTuple, Optional, Sequence, Tuple

import torch

_COMPARE_BLOCK = 64  # tokens per slice compare while searching for a mismatch


class KVIntegrityError(AssertionError):
    """A broken cache invariant (lock count, sizes, a slot held twice). Raised explicitly,
    so `python -O` keeps the audit; an AssertionError subclass for callers expecting one."""


class TreeNode:
    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access_time",
                 "namespace", "id", "host_value", "hit_count", "host_ref", "hits")
    _ids = itertools.count()

    def __init__(self, key: Tuple[int, ...] = (), value: Optional[torch.Tensor] = None,
                 parent: Optional["TreeNode"] = None, namespace: Hashable = None,
                 last_access_time: int = 0):
        self.children: dict = {}
        self.parent = parent
        self.key = key                      # token ids, len a multiple of page_size
        self.value = value                  # int64 [len(key)] KV slots; None at the root
        self.lock_ref = 0
        self.last_access_time = last_access_time
        self.namespace = namespace          # the subtree this node lives in
        self.id = next(TreeNode._ids)       # heap tie-break: older nodes first
        # HiCache tiers (cache/hiradix.py); a plain RadixCache leaves them at None / 0.
        self.host_value: Optional[torch.Tensor] = None  # int64 [len(key)] host-pool slots
        self.hit_count = 0                  # inserts through this node (write_through_selective)
        self.host_ref = 0                   # pins against host eviction (a load-back in progress)
        self.hits = 0                       # admissions whose cached prefix ran through this node

    @property
    def evicted(self) -> bool:
        """No device copy (the KV lives on the host tier only)."""
        return self.value is None

    def __repr__(self) -> str:
        head = ",".join(map(str, self.key[:6])) + (",..." if len(self.key) > 6 else "")
        return (f"TreeNode(id={self.id}, ns={self.namespace!r}, key=[{head}] len={len(self.key)}, "
                f"lock_ref={self.lock_ref}, t={self.last_access_time})")


class MatchResult(NamedTuple):
    indices: torch.Tensor   # int64 [matched_tokens], a fresh tensor the caller may keep
    last_node: TreeNode     # deepest matched node (the root when nothing matched)


def _common_prefix_len(node_key: tuple, key: tuple, start: int) -> int:
    """Length of the common prefix of `node_key` and `key[start:]`, compared in C slices."""
    n = min(len(node_key), len(key) - start)
    if node_key[:n] == key[start:start + n]:
        return n
    i = 0
    while i < n:  # find the block holding the first mismatch, then the token
        j = min(i + _COMPARE_BLOCK, n)
        if node_key[i:j] != key[start + i:start + j]:
            break
        i = j
    while node_key[i] == key[start + i]:
        i += 1
    return i


def _head(value: Optional[torch.Tensor], n: int) -> Optional[torch.Tensor]:
    return None if value is None else value[:n].clone()


def _tail(value: Optional[torch.Tensor], n: int) -> Optional[torch.Tensor]:
    return None if value is None else value[n:].clone()


class RadixCache:
    """Prefix cache over token ids; see the module docstring for the invariants."""

    def __init__(self, allocator, page_size: int = 1, disable: bool = False):
        alloc_page = getattr(allocator, "page_size", page_size)
        if page_size < 1 or alloc_page != page_size:
            raise ValueError(f"RadixCache: page_size must be >= 1 and equal the allocator's "
                             f"({alloc_page}), got {page_size}")
        self.allocator = allocator
        self.page_size = page_size
        self.disable = disable
        self.root: Optional[TreeNode] = None
        self.reset()

    # ------------------------------------------------------------------ sizes
    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def total_size(self) -> int:
        return self._evictable + self._protected

    def reset(self) -> None:
        """Drop every node and give all their slots back. Only valid with nothing locked."""
        if self.root is not None:
            if not (self._protected == 0):
                raise KVIntegrityError(f"reset with {self._protected} tokens locked")
            for node in self._nodes():
                self.allocator.free(node.value)
        self.root = TreeNode()
        self.root.lock_ref = 1
        self._clock = 0
        self._evictable = 0
        self._protected = 0

    # ------------------------------------------------------------ match/insert
    def match_prefix(self, token_ids: Sequence[int], namespace: Hashable = None) -> MatchResult:
        """Longest cached page-aligned prefix of `token_ids` in `namespace`.

        Splits a node when the match ends inside it, so `last_node` ends exactly at the
        matched length; touches the access time of every node on the path.
        """
        key = self._aligned_key(token_ids)
        if self.disable or not key:
            return MatchResult(self._empty(), self.root)
        node, _, path = self._descend(key, namespace)
        return MatchResult(torch.cat([n.value for n in path]) if path else self._empty(), node)

    def insert(self, token_ids: Sequence[int], kv_indices: torch.Tensor,
               namespace: Hashable = None) -> int:
        """Cache the page-aligned part of `token_ids` with KV slots `kv_indices`.

        Returns how many leading tokens were already cached. The caller keeps (and must
        free) its slots `kv_indices[:returned]` and any unaligned tail; the tree takes
        ownership of `kv_indices[returned:aligned_len]` (stored as a clone). A disabled
        cache stores nothing and returns the aligned length, so the caller keeps all.
        """
        key = self._aligned_key(token_ids)
        if len(kv_indices) < len(key):
            raise ValueError(f"insert: expected at least {len(key)} KV indices for the "
                             f"page-aligned tokens, got {len(kv_indices)}")
        if self.disable or not key:
            return len(key)
        node, matched, _ = self._descend(key, namespace)
        if matched < len(key):
            value = kv_indices[matched:len(key)].to(torch.int64).clone()
            leaf = TreeNode(key[matched:], value, node, namespace, self._clock)
            node.children[self._child_key(leaf)] = leaf
            self._evictable += len(leaf.key)
        return matched

    def _aligned_key(self, token_ids: Sequence[int]) -> tuple:
        n = len(token_ids) - len(token_ids) % self.page_size
        return tuple(token_ids[:n])

    def _empty(self) -> torch.Tensor:
        return torch.empty((0,), dtype=torch.int64)

    def _page_key(self, parent: TreeNode, namespace: Hashable, key: tuple, pos: int):
        page = key[pos] if self.page_size == 1 else key[pos:pos + self.page_size]
        return (namespace, page) if parent is self.root else page

    def _child_key(self, node: TreeNode):
        """The key under which `node` sits in `node.parent.children`."""
        return self._page_key(node.parent, node.namespace, node.key, 0)

    def _descend(self, key: tuple, namespace: Hashable) -> Tuple[TreeNode, int, List[TreeNode]]:
        """Walk `key` down from the root, touching each node and splitting where the match
        ends inside one. Returns (deepest matched node, matched length, nodes on the path)."""
        self._clock += 1
        node, pos, path = self.root, 0, []
        while pos < len(key):
            child = node.children.get(self._page_key(node, namespace, key, pos))
            if child is None:
                break
            n = _common_prefix_len(child.key, key, pos)
            n -= n % self.page_size  # >= one page: the first page matched the dict key
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access_time = self._clock
            path.append(child)
            node, pos = child, pos + n
        return node, pos, path

    def _split(self, node: TreeNode, n: int) -> TreeNode:
        """Cut `node` after `n` tokens; returns the new prefix node, `node` keeps the suffix."""
        parent = node.parent
        prefix = TreeNode(node.key[:n], _head(node.value, n), parent, node.namespace,
                          node.last_access_time)
        prefix.lock_ref = node.lock_ref  # same descendants, same locks
        prefix.host_ref, prefix.hit_count, prefix.hits = node.host_ref, node.hit_count, node.hits
        prefix.host_value = _head(node.host_value, n)
        parent.children[self._child_key(node)] = prefix  # same first page as before
        node.key, node.value, node.parent = node.key[n:], _tail(node.value, n), prefix
        node.host_value = _tail(node.host_value, n)
        prefix.children[self._child_key(node)] = node
        return prefix

    # ------------------------------------------------------------------ locks
    def inc_lock_ref(self, node: TreeNode) -> None:
        """Protect `node` and its ancestors from eviction (one reference)."""
        for n in self._path_to_root(node, "inc_lock_ref"):
            if n.lock_ref == 0:
                self._evictable -= len(n.key)
                self._protected += len(n.key)
            n.lock_ref += 1

    def dec_lock_ref(self, node: TreeNode) -> None:
        """Drop one reference taken by `inc_lock_ref(node)`."""
        path = self._path_to_root(node, "dec_lock_ref")
        if not (all(n.lock_ref > 0 for n in path)):
            raise KVIntegrityError(f"dec_lock_ref below zero on {node!r}")
        for n in path:
            n.lock_ref -= 1
            if n.lock_ref == 0:
                self._protected -= len(n.key)
                self._evictable += len(n.key)

    def record_hit(self, node: TreeNode) -> None:
        """A request was admitted with its cached prefix ending at `node`: count a hit on
        it and its ancestors (the Inspector shows `hits`; nothing decides on them)."""
        while node is not None and node is not self.root:
            node.hits += 1
            node = node.parent

    def _path_to_root(self, node: TreeNode, caller: str) -> List[TreeNode]:
        """`node` and its ancestors, the root excluded; asserts `node` is in this tree."""
        path = []
        while node is not self.root:
            if not (node is not None and node.parent is not None):
                raise KVIntegrityError(f"{caller}: node is not in this tree (evicted or reset?)")
            path.append(node)
            node = node.parent
        return path

    # --------------------------------------------------------------- eviction
    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` tokens (whole leaves, least recently used first) if
        that many are evictable; returns the tokens freed."""
        if self.disable:
            return 0
        return self._evict_lru(num_tokens, lambda n: not n.children and n.lock_ref == 0, self._delete_leaf)

    def _evict_lru(self, num_tokens: int, candidate: Callable[[TreeNode], bool],
                   remove: Callable[[TreeNode], int]) -> int:
        """`remove` (returning the tokens it freed) the least recently used nodes that are
        `candidate`s until `num_tokens` are freed or none is left; a parent that becomes a
        candidate once its child is gone joins the queue."""
        if num_tokens <= 0:
            return 0
        heap = [(n.last_access_time, n.id, n) for n in self._nodes() if candidate(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            freed += remove(node)
            if parent is not self.root and candidate(parent):
                heapq.heappush(heap, (parent.last_access_time, parent.id, parent))
        return freed

    def _delete_leaf(self, leaf: TreeNode) -> int:
        self.allocator.free(leaf.value)
        del leaf.parent.children[self._child_key(leaf)]
        leaf.parent = None  # a stale reference now fails loudly in the lock calls
        self._evictable -= len(leaf.key)
        return len(leaf.key)

    @property
    def clock(self) -> int:
        """The logical clock `last_access_time` values come from."""
        return self._clock

    def nodes(self):
        """Every node but the root, parents before children (read-only use)."""
        return self._nodes()

    def _nodes(self):
        """Every node but the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    # -------------------------------------------------------------- auditing
    def check_integrity(self) -> None:
        """Recompute sizes and lock refs from the tree and assert the invariants above."""
        root = self.root
        if not (root.parent is None and root.key == () and root.lock_ref == 1):
            raise KVIntegrityError(repr(root))
        evictable = protected = 0
        slots = []
        for node in [root, *self._nodes()]:
            child_locks = 0
            for page_key, child in node.children.items():
                if not (child.parent is node):
                    raise KVIntegrityError(f"{child!r} has the wrong parent")
                if not (page_key == self._child_key(child)):
                    raise KVIntegrityError(f"{child!r} filed under {page_key!r}")
                if not (node is root or child.namespace == node.namespace):
                    raise KVIntegrityError(f"{child!r} crossed namespaces")
                if not (node is root or child.last_access_time <= node.last_access_time):
                    raise KVIntegrityError(repr(child))
                child_locks += child.lock_ref
            if node is root:
                continue
            n = len(node.key)
            if not (n > 0 and n % self.page_size == 0):
                raise KVIntegrityError(f"{node!r}: key length not a page multiple")
            if node.value is None:  # on a lower tier only: no device slots, never locked
                self._check_evicted(node)
                continue
            if not (node.value.dtype == torch.int64 and tuple(node.value.shape) == (n,)):
                raise KVIntegrityError(f"{node!r}: value shape {tuple(node.value.shape)}, expected ({n},)")
            if not (node.lock_ref >= child_locks):
                raise KVIntegrityError(f"{node!r}: lock_ref below its children's {child_locks}")
            if node.lock_ref:
                protected += n
            else:
                evictable += n
            slots.append(node.value)
        if not ((evictable, protected) == (self._evictable, self._protected)):
            raise KVIntegrityError(
                f"sizes: counted evictable={evictable} protected={protected}, "
                f"counters say {self._evictable} / {self._protected}")
        if slots:
            every = torch.cat(slots)
            if not (torch.unique(every).numel() == every.numel()):
                raise KVIntegrityError("a KV slot is held twice")

    def _check_evicted(self, node: TreeNode) -> None:
        raise KVIntegrityError(f"{node!r} has no KV slots")

    def pretty_print(self) -> str:
        """Print (and return) the tree, one node per line, indented by depth."""
        lines = [f"root  evictable={self._evictable} protected={self._protected}"]
        stack = [(child, 1) for child in reversed(list(self.root.children.values()))]
        while stack:
            node, depth = stack.pop()
            lines.append("  " * depth + repr(node))
            stack.extend((child, depth + 1) for child in reversed(list(node.children.values())))
        text = "\n".join(lines)
        print(text)
        return text
