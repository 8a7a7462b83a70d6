"""Fault isolation: the stages of a request's handling, how a failure in one finishes
only that request, and a test-only injector that makes a stage fail for chosen requests.

A failure while handling one request (an exception at one of the `Stage`s) finishes that
request with `FinishReason.error(500, "Internal error in <stage> ...: <Type>: <message>")`
and marks it `kv_suspect`: on release its KV is freed, never shared with the radix tree
(the step may have stopped half-way, e.g. between a jump-forward's rewrite and its
truncate). The scheduler then goes on with the others. A failure of a batched call
(forward, sampling, the channel send) fails the batch's requests (forward) or is retried
request by request (sampling, send), so only the culprit fails.

The injector is for tests only: the Engine and the Scheduler take it as a constructor
argument (it is not a ServerArgs field, a CLI flag or reachable over HTTP). Each check
site is `if self.faults is not None: self.faults.check(...)`: one attribute test when off.
"""

from __future__ import annotations

import enum
import logging
import threading
from dataclasses import dataclass
from typing import Iterable, List, Optional, Tuple

from lmprog_runtime.messages import FinishReason

logger = logging.getLogger(__name__)


class Stage(str, enum.Enum):
    ADMISSION = "admission"                # add_request: Req, Admission.check, grammar submit
    KV_ASSIGN = "admission (KV assign)"    # Admission: row, prefix match + lock, first slots
    FORWARD = "forward"                    # the whole batch's forward
    GRAMMAR_MASK = "grammar mask"          # a grammar writing its allowed-token row
    DRAFT = "speculative draft"            # the draft source proposing for one request
    SAMPLING = "sampling"                  # the sampler (batched; retried per request)
    GRAMMAR = "grammar advance"            # accept_token of the sampled token
    STOP_CHECK = "stop check"              # StopChecker (incremental detokenize for stop strings)
    JUMP_FORWARD = "jump-forward"          # JumpForward.propose drafting one request's forced text
    OUTPUT = "output delta"                # building a request's delta in the Outbox
    SEND = "output send"                   # the channel to the tokenizer manager
    KV_TRANSFER = "kv transfer"            # disaggregation: sending or installing a request's KV pages


class InjectedFault(RuntimeError):
    """Raised by `FaultInjector` (tests only)."""


def error_reason(stage: Stage, exc: BaseException) -> FinishReason:
    return FinishReason.error(500, f"Internal error in {stage.value}: {type(exc).__name__}: {exc}")


def fail_request(r, stage: Stage, exc: BaseException) -> None:
    """Finish `r` alone after `exc` at `stage`; its KV will be freed, not cached."""
    logger.exception("request %s failed in %s", r.rid, stage.value, exc_info=exc)
    r.kv_suspect = True
    r.finish(error_reason(stage, exc))


@dataclass(frozen=True)
class Fault:
    stage: Stage
    rid: str          # requests whose rid starts with this
    times: int = 1    # how many times it fires (then it is spent)
    after: int = 0    # matching checks it lets pass first (e.g. 3: a decode step, not the prefill)


class FaultInjector:
    """Armed faults; thread-safe (the overlap loop checks from two threads)."""

    def __init__(self, faults: Iterable[Fault] = ()):
        self._lock = threading.Lock()
        self._armed: List[List] = [[f, f.times, f.after] for f in faults]  # [fault, fires left, passes left]
        self.fired: List[Tuple[Stage, str]] = []  # (stage, rid) of every fault raised

    def arm(self, stage: Stage, rid: str, times: int = 1, after: int = 0) -> None:
        f = Fault(stage, rid, times, after)
        with self._lock:
            self._armed.append([f, f.times, f.after])

    def disarm(self) -> None:
        with self._lock:
            self._armed.clear()

    def check(self, stage: Stage, rid: str, spend: bool = True) -> None:
        """Raise `InjectedFault` if a fault is armed for (stage, rid) and has let its
        `after` checks pass. `spend=False` (a batched call that is retried per request on
        failure) raises without spending a fire: the retry's own check spends it."""
        with self._lock:
            entry = self._match(stage, rid)
            if entry is None:
                return
            if entry[2] > 0:
                entry[2] -= 1
                return
            if spend:
                entry[1] -= 1
                self.fired.append((stage, rid))
        raise InjectedFault(f"injected fault at {stage.value} for {rid}")

    def check_any(self, stage: Stage, rids: Iterable[str], spend: bool = True) -> None:
        """A batched call: raise if a fault fires for any of `rids`."""
        for rid in rids:
            self.check(stage, rid, spend)

    def _match(self, stage: Stage, rid: str) -> Optional[List]:
        for entry in self._armed:
            fault, left, _ = entry
            if left > 0 and fault.stage is stage and rid.startswith(fault.rid):
                return entry
        return None
