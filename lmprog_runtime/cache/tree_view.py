"""A bounded, JSON-ready picture of a radix tree (RadixCache or HiRadixCache) for the
Inspector (`/inspect/state`). Read-only: it walks the nodes, splits nothing, touches no
access time and takes no lock.

Shape (every size in tokens; `last_access` is the tree's logical clock, `clock` its
current value):

    {"clock", "num_nodes", "shown", "truncated", "total_tokens", "evictable_tokens",
     "locked_tokens", "host_tokens"?, "eviction_next": [node id, ...],
     "nodes": [{"id", "parent", "depth", "tokens", "text", "subtree_tokens", "hits",
                "lock_ref", "last_access", "tier", "backed_up", "namespace",
                "children", "hidden_children", "evict_rank"}]}

Bounding: past `max_nodes` nodes, the nodes with the largest subtrees (in tokens) are
kept, shallower first on ties. A parent's subtree is never smaller than its child's, so
the kept set is connected: every kept node's parent is kept (or is the root).
`hidden_children` counts a kept node's children that were left out.
"""

from __future__ import annotations

import heapq
from typing import Callable, Dict, List, Optional, Sequence

EDGE_TOKENS = 12  # tokens of an edge decoded for its label
EDGE_CHARS = 40   # label length at most, in characters


def _namespace(ns) -> Optional[dict]:
    """A node's namespace, (cache_salt, extra_key) or None, as JSON."""
    if ns is None:
        return None
    salt, extra = ns
    return {"cache_salt": salt, "extra_key": extra}


def _label(decode: Callable[[Sequence[int]], str], key: tuple) -> str:
    try:
        text = decode(key[:EDGE_TOKENS])
    except Exception:  # noqa: BLE001 - a label is never worth failing the snapshot
        text = " ".join(map(str, key[:EDGE_TOKENS]))
    if len(key) > EDGE_TOKENS or len(text) > EDGE_CHARS:
        text = text[:EDGE_CHARS] + "…"
    return text


def _labels(nodes: List, decode, cache: Optional[dict]) -> Dict[int, str]:
    """Edge label by node id. `cache` (kept by the caller between snapshots) maps
    (node id, key length) -> label: a node's key only ever changes by a split, which
    shortens it, so the pair names one key. Left holding the given nodes' labels only."""
    out: Dict[int, str] = {}
    fresh: dict = {}
    for n in nodes:
        k = (n.id, len(n.key))
        text = cache.get(k) if cache is not None else None
        out[n.id] = fresh[k] = text if text is not None else _label(decode, n.key)
    if cache is not None:
        cache.clear()
        cache.update(fresh)
    return out


def eviction_order(tree, nodes: List, k: int) -> List[int]:
    """Ids of the next `k` nodes device eviction would take, in order: the same LRU
    walk as `RadixCache._evict_lru`, simulated (a node becomes a candidate once every
    device-resident child of it has gone)."""
    gone: set = set()

    def candidate(n) -> bool:
        if n.value is None or n.lock_ref:
            return False
        for c in n.children.values():
            if c.value is not None and c.id not in gone:
                return False
        return True

    heap = [(n.last_access_time, n.id, n) for n in nodes if candidate(n)]
    heapq.heapify(heap)
    out: List[int] = []
    while heap and len(out) < k:
        _, _, node = heapq.heappop(heap)
        out.append(node.id)
        gone.add(node.id)
        parent = node.parent
        if parent is not tree.root and candidate(parent):
            heapq.heappush(heap, (parent.last_access_time, parent.id, parent))
    return out


def _measure(tree, nodes: List) -> tuple:
    """(depth by id, subtree tokens by id); `nodes` lists parents before children."""
    depth: Dict[int, int] = {tree.root.id: 0}
    for n in nodes:
        depth[n.id] = depth[n.parent.id] + 1
    sub: Dict[int, int] = dict.fromkeys(depth, 0)
    for n in reversed(nodes):  # children before parents: a node's total is final here
        total = sub[n.id] + len(n.key)
        sub[n.id] = total
        sub[n.parent.id] += total
    return depth, sub


def _select(nodes: List, depth: dict, sub: dict, max_nodes: int) -> List:
    if len(nodes) <= max_nodes:
        return nodes
    ranked = heapq.nsmallest(max_nodes, nodes, key=lambda n: (-sub[n.id], depth[n.id], n.id))
    return sorted(ranked, key=lambda n: (depth[n.id], n.id))  # parents before children


def _tier(n) -> str:
    """Where the node's KV is: device (L1), host (L2 only) or storage (L3 only, by page hash)."""
    if n.value is not None:
        return "device"
    return "host" if n.host_value is not None else "storage"


def _node(n, depth: dict, sub: dict, kept: set, rank: dict, labels: dict) -> dict:
    children = n.children.values()
    return {
        "id": n.id, "parent": n.parent.id, "depth": depth[n.id], "tokens": len(n.key),
        "text": labels[n.id], "subtree_tokens": sub[n.id], "hits": n.hits,
        "lock_ref": n.lock_ref, "last_access": n.last_access_time,
        "tier": _tier(n), "backed_up": n.host_value is not None,
        "namespace": _namespace(n.namespace), "children": len(children),
        "hidden_children": sum(c.id not in kept for c in children), "evict_rank": rank.get(n.id),
    }


def tree_view(tree, decode: Callable[[Sequence[int]], str], max_nodes: int, evict_k: int = 16,
              label_cache: Optional[dict] = None) -> dict:
    """The picture described in the module docstring; `decode(token_ids) -> str`. Pass the
    same `label_cache` dict to successive calls to decode only nodes that are new."""
    nodes = list(tree.nodes())
    depth, sub = _measure(tree, nodes)
    shown = _select(nodes, depth, sub, max_nodes)
    kept = {n.id for n in shown}
    order = eviction_order(tree, nodes, evict_k)
    rank = {nid: i for i, nid in enumerate(order)}
    labels = _labels(shown, decode, label_cache)
    view = {
        "root": tree.root.id, "clock": tree.clock, "num_nodes": len(nodes), "shown": len(shown),
        "truncated": len(nodes) - len(shown), "total_tokens": tree.total_size(),
        "evictable_tokens": tree.evictable_size(), "locked_tokens": tree.protected_size(),
        "root_children": len(tree.root.children), "eviction_next": order,
        "nodes": [_node(n, depth, sub, kept, rank, labels) for n in shown],
    }
    if hasattr(tree, "host_total_size"):
        view["host_tokens"] = tree.host_total_size()
    return view
