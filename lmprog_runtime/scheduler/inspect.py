"""The Inspector's snapshot: what `/inspect/state` shows, built by the scheduler between
steps from what it already keeps (docs/inspector.md).

The hot path pays for one thing only: `StepRing.record`, a tuple of a few floats per
step. Everything else is read when a snapshot is asked for (about once a second while
the page is open) and costs O(tree nodes + requests) there. Building a snapshot changes
nothing: no tree match, no split, no access-time touch, no lock.

Top-level shape (seconds are wall seconds, sizes tokens):
    {"time", "tree": cache/tree_view.py's view or None (cache off), "running": [...],
     "waiting": [...], "waiting_truncated", "grammar_queue": [...], "retractions",
     "steps": [...], "pool": {...}, "host_pool": {...} | None, "grammars": {...},
     "handoffs": {"fields": HANDOFF_FIELDS, "items": [...]}, "counters": {...}}
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Callable, List, Optional

from lmprog_runtime.cache.tree_view import tree_view
from lmprog_runtime.messages import INSPECT_MAX_NODES_CAP, ControlReply, InspectReq

logger = logging.getLogger(__name__)

STEP_RING = 240       # steps kept for the timeline
MAX_QUEUE_ROWS = 500  # waiting requests listed at most (the rest are counted)
EVICT_NEXT = 16       # nodes listed in eviction order
# One transfer of a prefill→decode handoff, as a transfer engine reports it through
# `Scheduler.handoff_probe` (bytes; seconds since the transfer started).
HANDOFF_FIELDS = ("id", "rid", "direction", "peer", "state", "bytes", "bytes_done", "elapsed_s")
STEP_FIELDS = ("t", "step_s", "forward_s", "cpu_s", "overlapped_s", "mask_s", "batch", "tokens")


class StepRing:
    """The last `size` steps, one tuple each: (end time [monotonic s], step wall s,
    forward wall s, scheduler CPU s overlapped with the forward, cumulative mask s,
    requests in the batch, tokens computed)."""

    def __init__(self, size: int = STEP_RING):
        self.buf: deque = deque(maxlen=size)

    def record(self, step_s: float, forward_s: float, overlapped_s: float, mask_total_s: float,
               batch: int, tokens: int) -> None:
        self.buf.append((time.monotonic(), step_s, forward_s, overlapped_s, mask_total_s, batch, tokens))

    def rows(self) -> List[dict]:
        """Oldest first; `cpu_s` = the step's wall time not spent waiting on the forward,
        `mask_s` = this step's grammar mask time."""
        out, prev_mask = [], None
        for t, step_s, fwd, overlapped, mask_total, batch, tokens in self.buf:
            mask = 0.0 if prev_mask is None else max(mask_total - prev_mask, 0.0)
            prev_mask = mask_total
            out.append(dict(zip(STEP_FIELDS, (t, step_s, fwd, max(step_s - fwd, 0.0), overlapped, mask,
                                              batch, tokens))))
        return out


def _grammar_kind(req) -> Optional[str]:
    g = req.sampling.grammar
    return g[0] if g else None


def _running_row(r, now: float) -> dict:
    row = {"rid": r.rid, "prompt_tokens": r.prompt_len, "cached_tokens": r.cached_tokens,
           "generated_tokens": len(r.output_ids), "max_new_tokens": r.max_new_tokens, "kv_len": r.kv_len,
           "grammar": _grammar_kind(r), "retractions": r.num_retractions, "age_s": now - r.created,
           "prefilling": r.kv_len < r.prompt_len, "finished": r.finished}
    if r.spec is not None:
        v, _, accepted = r.spec.as_tuple()
        row["spec_accept_length"] = (accepted + v) / v if v else None
    return row


def _waiting_row(r, now: float, position: int, state: str = "waiting") -> dict:
    return {"position": position, "rid": r.rid, "prompt_tokens": r.prompt_len,
            "generated_tokens": len(r.output_ids), "grammar": _grammar_kind(r),
            "retractions": r.num_retractions, "waited_s": now - r.created, "state": state}


def policy_order(waiting, last_order) -> List:
    """The waiting queue in the order admission last ranked it (`last_order`, a list the
    policy returned), then the requests that arrived since, in arrival order."""
    present = {id(r) for r in waiting}
    ranked = [r for r in (last_order or ()) if id(r) in present]
    seen = {id(r) for r in ranked}
    return ranked + [r for r in waiting if id(r) not in seen]


def _queues(s, now: float) -> dict:
    ordered = policy_order(s.waiting, s.admission.last_order)
    rows = [_waiting_row(r, now, i) for i, r in enumerate(ordered[:MAX_QUEUE_ROWS])]
    compiling = [_waiting_row(r, now, -1, "compiling grammar") for r in s.grammars.waiting[:MAX_QUEUE_ROWS]]
    return {"running": [_running_row(r, now) for r in s.running], "waiting": rows,
            "waiting_truncated": max(len(ordered) - MAX_QUEUE_ROWS, 0), "grammar_queue": compiling,
            "policy": s.admission.policy.name}


def pool_view(kv, running) -> dict:
    """Device KV slots by owner. `step_allocated`: slots given to the step now computing
    (the overlap loop answers during a forward) and not yet committed to a request."""
    total, free = kv.allocator.size, kv.allocator.available_size()
    evictable = kv.tree.evictable_size() if kv.cache_enabled else 0
    locked = kv.tree.protected_size() if kv.cache_enabled else 0
    held = kv.held_by(running)
    return {"total": total, "free": free, "tree_evictable": evictable, "tree_locked": locked,
            "request_held": held, "step_allocated": total - free - evictable - locked - held,
            "page_size": kv.page_size}


def host_pool_view(kv) -> Optional[dict]:
    if kv.hicache is None:
        return None
    host = kv.tree.host_allocator
    return {"total": host.size, "free": host.available_size(), "tree": kv.tree.host_total_size(),
            "prefetch_held": kv.hicache.host_held()}


def grammar_view(s) -> dict:
    backend = s.grammars.backend
    entries = backend.cache_entries() if backend is not None and hasattr(backend, "cache_entries") else []
    rows = s.stats["mask_rows"]
    return {"backend": s.args.grammar_backend, "entries": entries, "compiling": len(s.grammars),
            "mask_s_total": s.stats["mask_s"], "mask_rows_total": rows,
            "mask_s_per_row": s.stats["mask_s"] / rows if rows else None}


def handoff_view(probe: Optional[Callable[[], list]]) -> dict:
    """Transfers in flight from `probe()` (a transfer engine's hook); [] until one exists."""
    items: list = []
    if probe is not None:
        try:
            items = [{k: t.get(k) for k in HANDOFF_FIELDS} for t in probe()]
        except Exception:  # noqa: BLE001 - a broken probe must not break the snapshot
            logger.exception("handoff probe failed")
    return {"fields": list(HANDOFF_FIELDS), "items": items, "enabled": probe is not None}


def _counters(s) -> dict:
    keep = ("num_prompt_tokens", "num_cached_tokens", "num_generated_tokens", "num_retractions",
            "num_steps", "forward_s", "step_s", "num_jump_forward_tokens")
    out = {k: s.stats[k] for k in keep}
    out["last_gen_throughput"] = s.last_gen_throughput
    out["new_token_ratio"] = s.admission.new_token_ratio
    return out


def build_snapshot(s, max_nodes: int, include_tree: bool = True) -> dict:
    """The snapshot of scheduler `s`; at most `max_nodes` tree nodes (capped). `tree_s`:
    seconds the tree walk took (None when skipped: `tree` is then None too)."""
    t0 = time.perf_counter()
    max_nodes = max(1, min(int(max_nodes), INSPECT_MAX_NODES_CAP))
    kv = s.kv
    walk = include_tree and kv.cache_enabled
    tree = tree_view(kv.tree, s.tokenizer.decode, max_nodes, EVICT_NEXT, s.edge_labels) if walk else None
    tree_s = time.perf_counter() - t0 if walk else None
    snap = {"cache_enabled": kv.cache_enabled, "tree_s": tree_s, "time": time.time(), "monotonic": time.monotonic(), "tree": tree, **_queues(s, time.monotonic()),
            "retractions": s.stats["num_retractions"], "steps": s.steps.rows(), "pool": pool_view(kv, s.running),
            "host_pool": host_pool_view(kv), "grammars": grammar_view(s), "handoffs": handoff_view(s.handoff_probe),
            "counters": _counters(s), "speculative": s.speculator is not None,
            "overlap": s._forward_pool is not None, "weight_version": s.weights.version}
    snap["snapshot_s"] = time.perf_counter() - t0
    return snap


def inspect_reply(s, msg: InspectReq) -> ControlReply:
    """The scheduler's answer; a snapshot that fails is a failed reply, never a dead loop."""
    try:
        return ControlReply("inspect", data=build_snapshot(s, msg.max_nodes, msg.include_tree))
    except Exception as e:  # noqa: BLE001
        logger.exception("inspector snapshot failed")
        return ControlReply("inspect", success=False, message=f"snapshot failed: {type(e).__name__}: {e}")
