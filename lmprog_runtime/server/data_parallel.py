"""Data parallelism: N scheduler replicas behind one TokenizerManager (`--dp-size N`).

    TokenizerManager.send ──> Dispatcher.send ──> replica r's channel   (r picked per request)
    TokenizerManager.handle_output <── Dispatcher.on_message(r, obj) <── replica r's channel

The dispatcher is the only part that knows there are several schedulers:
- a generate request goes to one live replica (`round_robin`, or `shortest_queue`: the fewest
  requests in flight; `auto` is round_robin, SGLang's default); `owner` remembers rid → replica
  until the request's final output, so an abort goes to the replica that holds it (a rid it
  does not know, which the scheduler may match as a prefix, goes to every replica);
- control requests (flush, internal state, weights, memory) go to every live replica and
  their replies are merged into one `ControlReply` (success only if all succeeded; `data` is
  replica 0's data with `dp_states`: each replica's data, by rank); an embedding request goes
  to one replica, like a generate request;
- a replica that goes down (`replica_down`) hands back the rids it held (their requests fail,
  nobody else's) and stops being picked until `replica_up`.
With one replica every message passes through unchanged (dp_size 1 is today's server).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Set

from lmprog_runtime.messages import AbortReq, BatchOutput, ControlReply, EmbedReq, TokenizedGenerateReq


@dataclass
class _FanOut:
    """One control request sent to several replicas; done when every expected rank replied."""

    kind: str
    expected: Set[int]
    replies: Dict[int, ControlReply] = field(default_factory=dict)

    @property
    def done(self) -> bool:
        return self.expected <= set(self.replies)


def per_replica(reply: ControlReply) -> List[Dict[str, Any]]:
    """The data of each replica in a (merged) reply, by rank."""
    return reply.data.get("dp_states") or [reply.data]


def merge_replies(kind: str, replies: Dict[int, ControlReply]) -> ControlReply:
    """One reply for a fanned-out control request (a single reply is returned unchanged)."""
    if len(replies) == 1:
        return next(iter(replies.values()))
    if not replies:
        return ControlReply(kind, success=False, message="no replica answered (all of them went down)")
    ranks = sorted(replies)
    failed = [f"replica {r}: {replies[r].message}" for r in ranks if not replies[r].success]
    messages = list(dict.fromkeys(replies[r].message for r in ranks))  # distinct, in rank order
    data = {**replies[ranks[0]].data, "dp_states": [dict(replies[r].data, dp_rank=r) for r in ranks]}
    return ControlReply(kind, success=not failed, message="; ".join(failed) if failed else messages[0],
                        data=data)


class Dispatcher:
    def __init__(self, senders: List[Callable[[Any], None]], method: str,
                 deliver: Callable[[Any], None]):
        """`senders[r]`: puts a message on replica r's channel; `deliver`: the
        TokenizerManager's `handle_output` (gets outputs and merged replies)."""
        self.senders = senders
        self.method = "round_robin" if method == "auto" else method
        self.deliver = deliver
        self.alive = [True] * len(senders)
        self.owner: Dict[str, int] = {}  # rid -> rank, until its final output
        self.inflight = [0] * len(senders)  # requests in flight per rank
        self.dispatched = [0] * len(senders)  # requests sent per rank since start
        self.fanouts: List[_FanOut] = []  # oldest first
        self._next = 0

    @property
    def size(self) -> int:
        return len(self.senders)

    def live_ranks(self) -> List[int]:
        return [r for r in range(self.size) if self.alive[r]]

    def pick(self) -> int:
        """The replica for the next request (a live one; rank 0 when none is)."""
        live = self.live_ranks() or [0]
        if self.method == "shortest_queue":
            return min(live, key=lambda r: (self.inflight[r], r))
        for _ in range(self.size):
            r = self._next % self.size
            self._next += 1
            if r in live:
                return r
        return live[0]

    # -- tokenizer manager -> replicas ----------------------------------------------------
    def send(self, obj: Any) -> None:
        if isinstance(obj, TokenizedGenerateReq):
            rank = self.pick()
            self.owner[obj.rid] = rank
            self.inflight[rank] += 1
            self.dispatched[rank] += 1
            self.senders[rank](obj)
        elif isinstance(obj, AbortReq):
            self._send_abort(obj)
        elif isinstance(obj, EmbedReq):
            rank = self.pick()
            self.fanouts.append(_FanOut(obj.kind, {rank}))
            self.senders[rank](obj)
        else:  # control requests (and shutdown): every live replica
            ranks = self.live_ranks()
            kind = getattr(obj, "kind", None) or _CONTROL_KINDS.get(type(obj).__name__)
            for r in ranks:
                self.senders[r](obj)
            if kind is not None:
                self.fanouts.append(_FanOut(kind, set(ranks)))
                self._deliver_done()  # no live replica: a failed reply now, not a hang

    def _send_abort(self, obj: AbortReq) -> None:
        rank = self.owner.get(obj.rid) if not obj.abort_all else None
        for r in ([rank] if rank is not None else self.live_ranks()):
            self.senders[r](obj)

    # -- replicas -> tokenizer manager ----------------------------------------------------
    def on_message(self, rank: int, obj: Any) -> None:
        if isinstance(obj, BatchOutput):
            for out in obj.outputs:
                if out.finished_reason is not None and self.owner.get(out.rid) == rank:
                    del self.owner[out.rid]
                    self.inflight[rank] -= 1
            self.deliver(obj)
        elif isinstance(obj, ControlReply):
            self._on_reply(rank, obj)
        else:
            self.deliver(obj)

    def _on_reply(self, rank: int, reply: ControlReply) -> None:
        for fan in self.fanouts:
            if fan.kind == reply.kind and rank in fan.expected and rank not in fan.replies:
                fan.replies[rank] = reply
                break
        else:  # nobody waits for it (say, a reply from before a restart): pass it on as is
            self.deliver(reply)
            return
        self._deliver_done()

    def _deliver_done(self) -> None:
        """Deliver the finished fan-outs in the order they were sent (one kind's replies
        reach the tokenizer manager's FIFO of waiters in order)."""
        done = [fan for fan in self.fanouts if fan.done]
        self.fanouts = [fan for fan in self.fanouts if not fan.done]
        for fan in done:
            self.deliver(merge_replies(fan.kind, fan.replies))

    # -- replica lifecycle ----------------------------------------------------------------
    def replica_down(self, rank: int) -> List[str]:
        """Rank `rank` is gone: stop picking it; the rids it held (to fail), oldest first.
        Fan-outs stop waiting for it; one that no other replica answers fails."""
        self.alive[rank] = False
        rids = [rid for rid, r in self.owner.items() if r == rank]
        for rid in rids:
            del self.owner[rid]
        self.inflight[rank] = 0
        for fan in self.fanouts:
            fan.expected.discard(rank)
        self._deliver_done()
        return rids

    def replica_up(self, rank: int) -> None:
        self.alive[rank] = True

    def load(self, rank: int) -> Dict[str, int]:
        return {"dp_rank": rank, "num_inflight_reqs": self.inflight[rank], "num_dispatched": self.dispatched[rank]}


# Control requests without a `kind` attribute, by class name -> the kind of their reply.
_CONTROL_KINDS = {"FlushCacheReq": "flush_cache", "GetInternalStateReq": "internal_state", "FreezeGcReq": "freeze_gc"}


def replica_args(args, rank: int):
    """The ServerArgs of replica `rank`: its share of the threads (total // dp_size, at least
    1) and, for HiCache's file storage, its own directory and share of the size limit.
    Everything else, the seed included, is the server's: outputs must not depend on which
    replica served a request."""
    if args.dp_size == 1:
        return args
    own = {"num_threads": max(1, total_threads(args) // args.dp_size)}
    if args.hicache_storage_backend == "file":  # one LRU bookkeeper per directory
        own.update(hicache_storage_dir=os.path.join(args.resolved_hicache_storage_dir, f"dp{rank}"),
                   hicache_storage_max_gb=args.hicache_storage_max_gb / args.dp_size)
    return args.replace(**own)


def total_threads(args) -> int:
    """--num-threads, else the cores this process may run on (its affinity mask)."""
    if args.num_threads:
        return args.num_threads
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
