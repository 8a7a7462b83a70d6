"""Waiting-queue order: fcfs, lpm (longest prefix match) and dfs-weight.

`dfs-weight` keeps SGLang's flag name but is simpler than SGLang's walk of the radix
tree: it groups waiting requests by their exact cached prefix and admits the largest
group first (ties: the longer prefix), arrival order within a group. Requests whose
cached prefixes differ but overlap are not grouped.

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

    def order(self, waiting: List, match_len: Callable) -> List:
        """Return `waiting` in admission order; `match_len(req)` is the cached-prefix length."""
        if self.name == "fcfs" or len(waiting) > CACHE_AWARE_QUEUE_LIMIT:
            return list(waiting)
        lens = {id(r): match_len(r) for r in waiting}
        if self.name == "lpm":
            # Stable: equal matches keep arrival order.
            return sorted(waiting, key=lambda r: -lens[id(r)])
        return self._dfs_weight(waiting, lens)

    @staticmethod
    def _dfs_weight(waiting: List, lens: Dict[int, int]) -> List:
        """Group requests by their exact cached prefix; the group with the most waiting
        requests first (then the longer prefix); arrival order inside a group."""
        groups: Dict[tuple, List] = defaultdict(list)
        for r in waiting:
            n = lens[id(r)]
            groups[(r.namespace, tuple(r.origin_input_ids[:n]))].append(r)
        ordered = sorted(groups.values(), key=lambda g: (-len(g), -lens[id(g[0])]))
        return [r for g in ordered for r in g]


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
