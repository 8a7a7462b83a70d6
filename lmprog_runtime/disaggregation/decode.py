"""The decode server's queue stages (SGLang's DecodePreallocQueue and DecodeTransferQueue).

    arrival ──▶ prealloc ──(room: a row, the cached prefix, slots for the rest)──▶ transfer
            ──(the pages and the first token arrived)──▶ running (no prefill forward)

Prealloc gives the request its ReqToTokenPool row and its radix-cache prefix (locked) like
admission does, then slots for prompt positions [prefix, prompt_len), counted as computed at
once (the request holds them; nothing else may write them), and sends their addresses with
the prefix length: pages the decode cache holds are not sent again. On Success the first
token goes through PostProcessor.on_token (stops, grammar, stream) and the request joins the
running batch, whose next step decodes from it.

A request that fails or is aborted after its slots went out keeps them in `draining` until
the prefill side confirms it writes no more (a failed TransferDone), its bootstrap server is
gone, or DISAGGREGATION_WAITING_TIMEOUT_S passed: then they are freed, never cached.
"""

from __future__ import annotations

import logging
import time
from typing import List, Tuple

from lmprog_runtime import config
from lmprog_runtime.disaggregation.base import KVPoll, TransferDone
from lmprog_runtime.disaggregation.conn import handoff, kv_bytes_per_token
from lmprog_runtime.messages import FinishReason
from lmprog_runtime.scheduler.faults import Stage, fail_request

logger = logging.getLogger(__name__)

LOGPROB_LISTS = ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs")


class DecodeStages:
    def __init__(self, manager, kv, admission, post, fail, stats: dict, faults=None):
        """`fail(req, reason)`: finish a request and send its final output (it holds no KV)."""
        self.m = manager
        self.kv = kv  # cache.manager.KVManager: every KV move of these requests goes through it
        self.admission = admission
        self.post = post
        self._fail = fail
        self.stats = stats
        self.faults = faults  # FaultInjector (tests only) or None
        self.prealloc: List[Tuple[object, object]] = []  # (Req, KVReceiver), no KV yet
        self.transfer: List[Tuple[object, object]] = []  # (Req, KVReceiver), slots held
        self.draining: List[Tuple[object, object, float]] = []  # finished, slots held: (Req, rcv, since)

    def takes(self, req) -> bool:
        return req.bootstrap is not None and req.max_new_tokens > 0

    def add(self, req) -> None:
        req.input_logprobs_done = True  # prompt logprobs come from the prefill server's response
        self.prealloc.append((req, self.m.receiver(req.bootstrap)))

    def __len__(self) -> int:
        return len(self.prealloc) + len(self.transfer) + len(self.draining)

    def state(self) -> dict:
        """Queue gauges (SGLang's names) for the scheduler's internal state."""
        return {"num_decode_prealloc_queue_reqs": len(self.prealloc),
                "num_decode_transfer_queue_reqs": len(self.transfer) + len(self.draining)}

    def live(self) -> list:
        """Requests holding KV outside `running` (for the integrity audit)."""
        return [r for r, _ in self.transfer] + [r for r, _, _ in self.draining]

    def handoffs(self) -> list:
        """Rooms in flight, for the Inspector (the prefill side writes one-sidedly: no progress
        is seen here until its TransferDone)."""
        bpt = kv_bytes_per_token(self.m.layout)
        return [handoff(rcv.room, req.rid, "receive", rcv.addr, rcv.state, rcv.tokens or None, bpt, None,
                        rcv.created) for req, rcv in self.prealloc + self.transfer]

    # -- each step ----------------------------------------------------------------------------
    def poll(self, running) -> Tuple[list, list]:
        """([], requests whose KV arrived: to the running batch)."""
        self._poll_prealloc(running)
        ready, keep = [], []
        for req, rcv in self.transfer:
            state = rcv.poll()
            if state is KVPoll.Failed:
                self._drop(req, rcv, FinishReason.error(500, f"KV transfer failed: {rcv.failure}"))
            elif state is KVPoll.Success:
                self._install(req, rcv.done)
                ready.append(req)
            else:
                keep.append((req, rcv))
        self.transfer = keep
        self._drain()
        return [], ready

    def _poll_prealloc(self, running) -> None:
        keep, blocked = [], False
        for req, rcv in self.prealloc:
            state = rcv.poll()
            if state is KVPoll.Failed:
                self.stats["num_disagg_failures"] += 1
                self._fail(req, FinishReason.error(500, f"KV bootstrap failed: {rcv.failure}"))
            elif state is KVPoll.WaitingForInput and not blocked and self._guarded_prealloc(req, rcv, running):
                if not req.finished:
                    self.transfer.append((req, rcv))
            else:
                blocked = blocked or state is KVPoll.WaitingForInput  # first come, first served
                keep.append((req, rcv))
        self.prealloc = keep

    def _guarded_prealloc(self, req, rcv, running) -> bool:
        """`_preallocate`, where an exception fails this request alone (its KV freed): True
        when the request left the queue (preallocated, or failed)."""
        try:
            return self._preallocate(req, rcv, running)
        except Exception as e:  # noqa: BLE001 - the scheduler goes on
            fail_request(req, Stage.KV_TRANSFER, e)
            if req.row is not None:
                self.kv.release(req, cache=False)
            rcv.abort(str(e))
            self._fail(req, req.finished_reason)
            return True

    def _preallocate(self, req, rcv, running) -> bool:
        """Row + cached prefix + slots for the rest of the prompt, sent to the prefill side;
        False (nothing held) when the pool or the row table has no room now."""
        holding = list(running) + [r for r, _ in self.transfer]
        if len(holding) >= self.admission.limits.max_running or not self.kv.assign(req):
            return False
        if self.faults is not None:  # row and prefix lock held, no slots yet
            self.faults.check(Stage.KV_TRANSFER, req.rid)
        prefix = req.kv_len
        n = req.prompt_len - prefix
        need = self.kv.pages_needed(prefix, n) * self.kv.page_size + self.admission.future_room(req)
        loc = None
        if need <= self.admission.free_room(holding) or not holding:
            loc = self.kv.alloc_extend(req, n)
        if loc is None:
            self.kv.unassign(req)
            return False
        self.kv.commit(req, n)  # held by the request from now on; written only by the transfer
        rcv.send_metadata(loc.tolist(), prefix)
        return True

    def _install(self, req, done: TransferDone) -> None:
        """The pages are in: share the prompt with the cache, take the first token."""
        meta = done.meta
        req.cached_tokens = meta["cached_tokens"]
        self.stats["num_prompt_tokens"] += req.prompt_len
        self.stats["num_cached_tokens"] += meta["cached_tokens"]
        self.stats["num_generated_tokens"] += 1
        self.stats["num_disagg_transfers"] += 1
        self.stats["disagg_bytes_received"] += done.bytes_sent
        self.stats["disagg_transfer_s"] += done.transfer_s
        try:
            if self.faults is not None:
                self.faults.check(Stage.KV_TRANSFER, req.rid)
            self.kv.cache_unfinished(req)
            if req.return_logprob:
                for name in LOGPROB_LISTS:
                    getattr(req, name).extend(meta.get(name, []))
        except Exception as e:  # noqa: BLE001 - this request fails alone
            fail_request(req, Stage.KV_TRANSFER, e)
            return
        self.post.on_token(req, meta["first_token"], None)  # isolates its own failures

    def _drop(self, req, rcv, reason: FinishReason) -> None:
        """`req` ends while the prefill side may still write its slots: drain them."""
        self.stats["num_disagg_failures"] += 1
        req.kv_suspect = True
        self._fail(req, reason)
        self.draining.append((req, rcv, time.monotonic()))

    def _drain(self) -> None:
        keep = []
        for req, rcv, since in self.draining:
            msg = self.m.peek(rcv.room)
            quiet = (rcv.done is not None or isinstance(msg, TransferDone)
                     or self.m.gone_since(rcv.addr, rcv.created) is not None
                     or time.monotonic() - since > config.DISAGGREGATION_WAITING_TIMEOUT_S)
            if quiet:
                self.m.take(rcv.room)
                self.kv.release(req, cache=False)
            else:
                keep.append((req, rcv, since))
        self.draining = keep

    def after_step(self) -> None:
        pass

    def abort(self, hit, reason: FinishReason) -> None:
        for req, rcv in [x for x in self.prealloc if hit(x[0])]:
            self.prealloc.remove((req, rcv))
            rcv.abort(reason.message)
            self._fail(req, reason)
        for req, rcv in [x for x in self.transfer if hit(x[0])]:
            self.transfer.remove((req, rcv))
            rcv.abort(reason.message)
            self._drop(req, rcv, reason)

    def idle_wait(self, timeout_s: float) -> None:
        if len(self):
            self.m.arrived.wait(timeout_s)
            self.m.arrived.clear()

    def close(self) -> None:
        self.m.close()
