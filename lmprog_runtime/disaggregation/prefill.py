"""The prefill server's queue stages (SGLang's PrefillBootstrapQueue and inflight queue).

    arrival ──▶ bootstrapping ──(decode handshake: its slots)──▶ waiting ──▶ running
                                   (the normal admission, radix cache and chunked prefill)
    after every step, for each running request with a sender:
        ship the pages its last chunk finished (whole pages; the prompt's tail at the end),
        once the first token is sampled: send its metadata, finish with length 0

A request computes one output token here (`max_new_tokens` 1 on its Req); the decode server
continues from it. Its KV is released as usual once the transfer reports Success (writes are
synchronous, so that is at once): the radix cache keeps the prompt. A failure on either side
(the decode half aborted, a write failed, no handshake in time) finishes it with a 500.
"""

from __future__ import annotations

import logging
from typing import Dict, List, Tuple

from lmprog_runtime.disaggregation.base import KVPoll
from lmprog_runtime.disaggregation.conn import handoff, kv_bytes_per_token
from lmprog_runtime.messages import FinishReason
from lmprog_runtime.scheduler.faults import Stage, error_reason, fail_request

logger = logging.getLogger(__name__)

LOGPROB_LISTS = ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs")


class PrefillStages:
    def __init__(self, manager, kv, fail, stats: dict, faults=None):
        """`fail(req, reason)`: the scheduler's way to finish a request that holds no KV."""
        self.m = manager
        self.kv = kv  # cache.manager.KVManager (reads request rows; moves nothing)
        self._fail = fail
        self.stats = stats
        self.faults = faults  # FaultInjector (tests only) or None
        self.bootstrapping: List[Tuple[object, object]] = []  # (Req, KVSender)
        self.active: Dict[str, Tuple[object, object, list]] = {}  # rid → (Req, KVSender, [shipped])

    def takes(self, req) -> bool:
        return req.bootstrap is not None and req.max_new_tokens > 0

    def add(self, req) -> None:
        req.max_new_tokens = 1  # the decode server generates the rest
        req.min_new_tokens = min(req.min_new_tokens, 1)
        self.bootstrapping.append((req, self.m.sender(req.bootstrap, req.prompt_len)))

    def __len__(self) -> int:
        return len(self.bootstrapping)

    def state(self) -> dict:
        """Queue gauges (SGLang's names) for the scheduler's internal state."""
        return {"num_prefill_bootstrap_queue_reqs": len(self.bootstrapping),
                "num_prefill_inflight_queue_reqs": len(self.active)}

    def live(self) -> list:
        return []  # bootstrapping requests hold no KV; admitted ones are in `running`

    def handoffs(self) -> list:
        """Rooms in flight, for the Inspector: waiting for the handshake, or shipping pages."""
        bpt = kv_bytes_per_token(self.m.layout)
        rooms = [(req, s) for req, s in self.bootstrapping] + [(req, s) for req, s, _ in self.active.values()]
        return [handoff(s.room, req.rid, "send", s.info.endpoint if s.info else "", s.state,
                        None if s.info is None else s.prompt_len - s.info.decode_prefix_len, bpt,
                        s.bytes_sent, s.created) for req, s in rooms]

    def poll(self, running) -> Tuple[list, list]:
        """(requests whose decode side is ready: to the waiting queue, []) — and fails the rest."""
        ready, keep = [], []
        for req, sender in self.bootstrapping:
            try:
                state = sender.poll()
            except Exception as e:  # noqa: BLE001 - e.g. a handshake that cannot be read: this room fails
                fail_request(req, Stage.KV_TRANSFER, e)
                sender.failure, state = str(e), KVPoll.Failed
            if state is KVPoll.Failed:
                self._count_failure()
                sender.abort(sender.failure)  # its decode half hears it (now, or when it handshakes)
                self._fail(req, FinishReason.error(500, f"KV bootstrap failed: {sender.failure}"))
            elif state is KVPoll.WaitingForInput:
                self.active[req.rid] = (req, sender, [0])
                ready.append(req)
            else:
                keep.append((req, sender))
        self.bootstrapping = keep
        return ready, []

    def after_step(self) -> None:
        """Ship what the step computed; finish requests whose transfer ended; answer aborts."""
        for rid, (req, sender, shipped) in list(self.active.items()):
            if not (req.finished and req.finished_reason.is_abort):
                try:
                    self._advance(req, sender, shipped)
                except Exception as e:  # this request fails alone, whatever stopped it this step
                    fail_request(req, Stage.KV_TRANSFER, e)
                    req.finished_reason = error_reason(Stage.KV_TRANSFER, e)
            if req.finished:
                if req.finished_reason.is_abort:
                    self._count_failure()
                    sender.abort(req.finished_reason.message or "aborted")
                del self.active[rid]
        self.m.answer_aborts()

    def _advance(self, req, sender, shipped: list) -> None:
        if sender.poll() is KVPoll.Failed:  # the decode half ended: beats a stop of this step
            req.finished_reason = FinishReason.error(500, f"KV transfer failed: {sender.failure}")
            return
        if req.row is None:  # waiting (or retracted): nothing computed to ship
            return
        if self.faults is not None:
            self.faults.check(Stage.KV_TRANSFER, req.rid)
        p = self.kv.page_size
        upto = req.prompt_len if req.kv_len >= req.prompt_len else req.kv_len // p * p
        if upto > shipped[0]:
            slots = self.kv.req_pool.table[req.row, shipped[0]:upto].tolist()
            sender.send(slots, shipped[0])
            shipped[0] = upto
            self.stats["num_disagg_chunks_sent"] += 1
        if req.output_ids and shipped[0] >= req.prompt_len:
            sender.finish(self._meta(req))
            self.stats["num_disagg_transfers"] += 1
            self.stats["disagg_bytes_sent"] += sender.bytes_sent
            self.stats["disagg_transfer_s"] += sender.transfer_s
            req.finished_reason = FinishReason.length(0)  # SGLang's prefill finish, whatever stopped it

    @staticmethod
    def _meta(req) -> dict:
        meta = {"first_token": req.output_ids[0], "cached_tokens": req.cached_tokens}
        if req.return_logprob:
            meta.update({name: getattr(req, name)[:1] for name in LOGPROB_LISTS})
        return meta

    def _count_failure(self) -> None:
        self.stats["num_disagg_failures"] += 1

    def abort(self, hit, reason: FinishReason) -> None:
        for req, sender in [x for x in self.bootstrapping if hit(x[0])]:
            self.bootstrapping.remove((req, sender))
            sender.abort(reason.message)
            self._fail(req, reason)

    def idle_wait(self, timeout_s: float) -> None:
        if self.bootstrapping:
            self.m.arrived.wait(timeout_s)
            self.m.arrived.clear()

    def close(self) -> None:
        self.m.close()
