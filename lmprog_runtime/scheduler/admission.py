"""Admission: which requests compute how many tokens this step, and who is retracted.

Limits (all in tokens unless named otherwise; derived once, in `AdmissionLimits.derive`):

    | limit               | meaning                                                          |
    |---------------------|------------------------------------------------------------------|
    | pool_tokens         | KV slots in the pool (`max_total_num_tokens` of the runner)      |
    | max_req_len         | prompt + output of one request: context - 1, and pool - 1        |
    | max_req_input_len   | longest prompt accepted: max_req_len - INPUT_HEADROOM            |
    | max_running         | requests holding a ReqToTokenPool row at once                    |
    | chunk_tokens        | tokens of prefill per step (chunked prefill), shared by requests |
    | max_prefill_tokens  | tokens of *new* requests admitted per step                       |
    | page_size           | KV is allocated in whole pages; a request's need rounds up       |

Per step:
- Every running request with pending tokens gets them. Decode-like ones (at most
  DECODE_LIKE_EXTEND pending: a decode, a jump-forward run) always get all of theirs
  and are not charged to the chunk budget; if the pool cannot hold them, requests are
  retracted (fewest output tokens first) until it can. A prefill still in chunks gets
  at most the remaining chunk budget.
- Waiting requests are then admitted in policy order while a row is free and the chunk
  and prefill budgets last. A request is admitted only when the pool, after the
  *reserved decode room* of the running ones, holds its chunk (page-rounded) and, if
  that chunk completes its prompt, its own future output: reserved room is
  `min(remaining output, NEW_TOKEN_CLIP) * new_token_ratio` per request. The ratio
  starts at INIT_NEW_TOKEN_RATIO (times `schedule_conservativeness`), decays while
  decoding goes well and jumps up after a retraction.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

from lmprog_runtime.messages import FinishReason
from lmprog_runtime.scheduler.batch import StepPlan
from lmprog_runtime.scheduler.limits import (DECODE_LIKE_EXTEND, MIN_NEW_TOKEN_RATIO_FACTOR,
                                             NEW_TOKEN_CLIP, NEW_TOKEN_RATIO_DECAY_STEPS,
                                             RETRACT_DECODE_STEPS, AdmissionLimits)
from lmprog_runtime.scheduler.faults import Stage, fail_request
from lmprog_runtime.scheduler.policy import SchedulePolicy, defer_shared_new_prefixes

logger = logging.getLogger(__name__)

@dataclass
class Admitted:
    """What one admission decided. The scheduler applies the queue moves."""

    plan: StepPlan
    admitted: List = field(default_factory=list)   # waiting → running, in this order
    retracted: List = field(default_factory=list)  # running → front of the waiting queue
    failed: List = field(default_factory=list)     # waiting → finished with an error (KV given back)


def _pending_decode_like(reqs) -> List:
    return [r for r in reqs if 0 < r.extend_len <= DECODE_LIKE_EXTEND]


class Admission:
    """Owns the new-token ratio; reads the pool through `kv` (a KVManager) and moves KV
    only through it."""

    def __init__(self, limits: AdmissionLimits, kv, policy: SchedulePolicy, faults=None):
        self.limits = limits
        self.kv = kv
        self.policy = policy
        self.faults = faults  # FaultInjector (tests only) or None
        self.min_ratio = limits.init_ratio * MIN_NEW_TOKEN_RATIO_FACTOR
        self.ratio_decay = (limits.init_ratio - self.min_ratio) / NEW_TOKEN_RATIO_DECAY_STEPS
        self.new_token_ratio = limits.init_ratio
        self.last_order: Optional[List] = None  # the waiting queue as last ranked (the Inspector's)

    # -- on arrival -------------------------------------------------------------------------
    def check(self, req) -> Optional[FinishReason]:
        """Clamp `req`'s limits to what fits; an error reason if it can never run."""
        L, lim = req.prompt_len, self.limits
        if L == 0:
            return FinishReason.error(400, "input_ids cannot be empty.", "BadRequest")
        if L >= lim.max_req_input_len:
            return FinishReason.error(
                400, f"Input length ({L} tokens) exceeds the maximum allowed length "
                     f"({lim.max_req_input_len} tokens). Use a shorter input.", "BadRequest")
        if req.return_logprob and req.logprob_start_len > L:
            return FinishReason.error(
                400, f"logprob_start_len={req.logprob_start_len} is higher than the number of "
                     f"input tokens ({L}).", "BadRequest")
        req.max_new_tokens = min(req.max_new_tokens, lim.output_room(L))
        req.min_new_tokens = min(req.min_new_tokens, req.max_new_tokens)
        return None

    def reset_ratio(self) -> None:
        """Idle: the next burst starts from the initial ratio."""
        self.new_token_ratio = self.limits.init_ratio

    # -- each step ------------------------------------------------------------------------------
    def admit(self, running: Sequence, waiting: Sequence, drafts: Optional[dict] = None) -> Admitted:
        """`drafts`: id(req) → PlannedDraft for running requests that may verify a draft
        this step (speculative decoding); a draft gets slots only from room no decode needs."""
        decision = Admitted(StepPlan())
        staying = self._fit_decodes(list(running), decision)
        budget = self._schedule_running(staying, decision.plan, drafts or {})
        self._admit_waiting(staying, waiting, budget, decision)
        return decision

    def decode_room_needed(self, reqs) -> int:
        """Tokens (page-rounded) the decode-like requests of `reqs` need this step."""
        pages = sum(self.kv.pages_needed(r.kv_len, r.extend_len) for r in _pending_decode_like(reqs))
        return pages * self.limits.page_size

    def _fit_decodes(self, running: List, decision: Admitted) -> List:
        """Retract until the decode-like requests fit; returns the requests that stay."""
        need = self.decode_room_needed(running)
        if need <= self.kv.available():
            if _pending_decode_like(running):
                self.new_token_ratio = max(self.new_token_ratio - self.ratio_decay, self.min_ratio)
            return running
        victims = sorted(running, key=lambda r: (len(r.output_ids), -r.prompt_len))
        while need > self.kv.available() and len(running) > 1 and victims:
            r = victims.pop(0)
            running.remove(r)
            self.kv.retract(r)
            r.num_retractions += 1
            decision.retracted.append(r)
            need = self.decode_room_needed(running)
        if need > self.kv.available() and len(running) == 1:
            running[0].finish(FinishReason.error(
                500, "Out of memory even after retracting all other requests in the decode batch."))
        if decision.retracted:
            self._raise_ratio(running, len(decision.retracted))
        return running

    def _raise_ratio(self, running: List, n_retracted: int) -> None:
        decoded = sum(len(r.output_ids) for r in running)
        total = sum(r.max_new_tokens for r in running)
        self.new_token_ratio = min(1.0, (decoded + RETRACT_DECODE_STEPS * len(running)) / (total + 1))
        logger.info("retracted %d request(s); new_token_ratio=%.3f", n_retracted, self.new_token_ratio)

    def _schedule_running(self, running: List, plan: StepPlan, drafts: dict) -> int:
        """Give every running request its pending tokens (plus its draft, if any, where the
        pool has room beyond this step's decodes); returns the chunk budget left."""
        budget = self.limits.chunk_tokens
        spare = self.kv.available() - self.decode_room_needed(running) if drafts else 0
        for r in running:
            if r.finished or r.extend_len == 0:
                continue
            decode_like = r.extend_len <= DECODE_LIKE_EXTEND
            n = r.extend_len if decode_like else min(r.extend_len, budget)
            if n <= 0:
                continue
            draft = drafts.get(id(r)) if r.extend_len == 1 else None
            if draft is not None:
                draft, cost = self._fit_draft(r, draft, spare)
                spare -= cost
            k = len(draft.tokens) if draft is not None else 0
            loc = self.kv.alloc_extend(r, n + k)
            if loc is None:
                continue  # a chunked prefill waits for room; decodes were made to fit above
            if not decode_like:
                budget -= n
            plan.add(r, n + k, loc, draft)
        return budget

    def _fit_draft(self, r, draft, spare: int):
        """The longest prefix of `draft` whose extra pages fit in `spare` tokens: (draft or
        None, tokens of room it takes)."""
        p = self.limits.page_size
        base = self.kv.pages_needed(r.kv_len, 1)
        k = len(draft.tokens)
        while k > 0 and (self.kv.pages_needed(r.kv_len, 1 + k) - base) * p > spare:
            k -= 1
        if k == 0:
            return None, 0
        if k < len(draft.tokens):
            draft = draft.prefix(k)
        return draft, (self.kv.pages_needed(r.kv_len, 1 + k) - base) * p

    def _reserved_room(self, running: List) -> float:
        """Output tokens the running requests may still need, scaled by the ratio."""
        return sum(self._future(r) for r in running)

    def free_room(self, running) -> float:
        """Pool tokens left after the reserved decode room of `running` (disaggregation/decode.py
        preallocates a request's prompt slots against it)."""
        return self.kv.available() - self._reserved_room(running)

    def future_room(self, r) -> float:
        return self._future(r)

    def _future(self, r) -> float:
        return min(r.max_new_tokens - len(r.output_ids), NEW_TOKEN_CLIP) * self.new_token_ratio

    def _candidates(self, waiting: Sequence) -> List:
        ordered = self.policy.order(list(waiting), self.kv.match_len, self.kv.match_node)
        if self.policy.name == "lpm" and len(ordered) > 1:
            deferred = defer_shared_new_prefixes(ordered, self.kv.match_len)
            ordered = [r for r in ordered if id(r) not in deferred]
        self.last_order = ordered
        return ordered

    def _admit_waiting(self, running: List, waiting: Sequence, budget: int, decision: Admitted) -> None:
        if not waiting or budget <= 0:
            return
        input_budget = self.limits.max_prefill_tokens
        for r in self._candidates(waiting):
            if len(running) >= self.limits.max_running or budget <= 0 or input_budget <= 0:
                break
            if not self.kv.storage_ready(r):  # its L3 prefetch goes on (the stop policy said wait)
                continue
            try:
                chunk = self._try_admit(r, running, budget)
            except Exception as e:  # this request alone fails; the others are still admitted
                self._give_back(r, e, decision)
                continue
            if chunk is None:
                break
            n, loc = chunk
            running.append(r)
            decision.admitted.append(r)
            decision.plan.add(r, n, loc)
            budget -= n
            input_budget -= n

    def _try_admit(self, r, running: List, budget: int):
        """Assign `r` a row and slots for its first chunk: (tokens, slots), None = no room."""
        if not self.kv.assign(r):
            return None
        if self.faults is not None:
            self.faults.check(Stage.KV_ASSIGN, r.rid)  # row and prefix lock held, no slots yet
        n = min(r.extend_len, budget)
        room = self.kv.available() - self._reserved_room(running)
        chunk = self.kv.pages_needed(r.kv_len, n) * self.limits.page_size
        own_future = self._future(r) if n == r.extend_len else 0
        fits = chunk + own_future <= room
        first = not running  # an empty batch always takes one request that fits the pool
        loc = self.kv.alloc_extend(r, n) if fits or (first and chunk <= self.kv.available()) else None
        if loc is None:  # no room this step: give back the row and the prefix lock
            self.kv.unassign(r)
            return None
        return n, loc

    def _give_back(self, r, exc: Exception, decision: Admitted) -> None:
        """`r` failed while being admitted: finish it and return its row and prefix lock
        (nothing of it was computed, so its KV is exactly the locked prefix)."""
        fail_request(r, Stage.KV_ASSIGN, exc)
        if r.row is not None:
            self.kv.release(r, cache=False)
        r.kv_len = r.cache_protected_len = 0
        decision.failed.append(r)
