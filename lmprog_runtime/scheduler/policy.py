"""Waiting-queue order: fcfs, lpm (longest prefix match) and dfs-weight.

`dfs-weight` walks the radix tree depth first: each waiting request hangs at the deepest
node of its cached prefix, a node's weight is the number of waiting requests in its
subtree, children are visited heaviest first and a node's own requests follow its
descendants'. Requests whose prefixes share more of
the tree are admitted together, so a shared prefix stays cached (and locked) while the
requests that reuse it run, and subtrees with more waiting requests go first.

Cache-aware policies need the radix tree's match length of every waiting request;
past `CACHE_AWARE_QUEUE_LIMIT` waiting requests that costs more than it saves, and
they fall back to fcfs, as SGLang does.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable, Dict, List

CACHE_AWARE_QUEUE_LIMIT = 128


class SchedulePolicy:
    def __init__(self, name: str, cache_enabled: bool):
        self.name = name if cache_enabled else "fcfs"

    def order(self, waiting: List, match_len: Callable, match_node: Callable) -> List:
        """Return `waiting` in admission order. `match_len(req)` is the cached-prefix
        length, `match_node(req)` the tree node where that prefix ends."""
        if self.name == "fcfs" or len(waiting) > CACHE_AWARE_QUEUE_LIMIT:
            return list(waiting)
        if self.name == "lpm":
            lens = {id(r): match_len(r) for r in waiting}
            # Stable: equal matches keep arrival order.
            return sorted(waiting, key=lambda r: -lens[id(r)])
        # Match every request first: a later match may split a node, which keeps the
        # deeper half, so the nodes recorded here stay where their prefixes end.
        return dfs_weight_order(waiting, [match_node(r) for r in waiting])


def dfs_weight_order(waiting: List, nodes: List) -> List:
    """Depth-first over the tree, heaviest child first (ties: the child whose first request
    arrived first); a node's own requests, in arrival order, come after its descendants'
    (as SGLang orders them). `nodes[i]` is where `waiting[i]`'s cached prefix ends."""
    here: Dict[object, List] = defaultdict(list)
    weight: Dict[object, int] = defaultdict(int)
    first_arrival: Dict[object, int] = {}
    root = None
    for i, (r, node) in enumerate(zip(waiting, nodes)):
        here[node].append(r)
        while node is not None:
            weight[node] += 1
            first_arrival.setdefault(node, i)
            root, node = node, node.parent
    out: List = []
    stack = [(root, False)] if root is not None else []
    while stack:  # iterative post-order: a path can be deeper than Python's recursion
        node, expanded = stack.pop()
        if expanded:
            out.extend(here.get(node, ()))
            continue
        stack.append((node, True))
        kids = [c for c in node.children.values() if weight.get(c)]
        kids.sort(key=lambda c: (weight[c], -first_arrival[c]))  # popped last = heaviest first
        stack.extend((c, False) for c in kids)
    return out


def defer_shared_new_prefixes(candidates: List, match_len: Callable, span: int = 32) -> set:
    """In-batch prefix de-duplication: among waiting requests that share `span` tokens
    right after their cached prefix, only the first is admitted this step; the ids of
    the rest are returned, to wait until that prefix is in the cache."""
    seen, deferred = set(), set()
    for r in candidates:
        n = match_len(r)
        if len(r.origin_input_ids) <= n + span:
            continue
        key = (r.namespace, tuple(r.origin_input_ids[: n + span]))
        if key in seen:
            deferred.add(id(r))
        seen.add(key)
    return deferred
