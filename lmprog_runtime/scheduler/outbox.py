"""Outbox: the deltas (`ReqOutput`) a step produces for the tokenizer manager.

A delta carries what the client has not seen: output tokens from the lowest index
rewritten since the last send (a jump-forward may rewrite the tail) and the new
logprob entries. Building a delta advances the request's "sent" marks.

A request whose delta cannot be built fails alone (`faults.Stage.OUTPUT`): a stream
delta's failure is raised to `PostProcessor.on_token`, which finishes the request; a
final delta's failure is replaced by a bare error output, so the client always hears.
"""

from __future__ import annotations

import logging
from typing import List, Tuple

from lmprog_runtime.messages import BatchOutput, FinishReason, ReqOutput
from lmprog_runtime.scheduler.faults import Stage, error_reason, fail_request

logger = logging.getLogger(__name__)


class Outbox:
    def __init__(self, stream_interval: int, faults=None):
        self.stream_interval = stream_interval  # server default; a request may set its own
        self.pending: List[ReqOutput] = []
        self.faults = faults  # FaultInjector (tests only) or None

    def stream(self, r) -> None:
        """A running streamed request produced tokens: send when the output reached a length
        n with n % interval == 1 since the last send (every step when interval is 1; a
        verified draft may add several tokens at once and step over such an n)."""
        if r.finished or not r.stream:
            return
        interval = r.sampling.stream_interval or self.stream_interval
        if interval == 1 or _marks(len(r.output_ids), interval) > _marks(r.sent_output_len, interval):
            self.pending.append(self._delta(r))

    def final(self, r) -> None:
        try:
            self.pending.append(self._delta(r))
        except Exception as e:
            fail_request(r, Stage.OUTPUT, e)
            self.error(r.rid, r.prompt_len, error_reason(Stage.OUTPUT, e))

    def error(self, rid: str, prompt_tokens: int, reason: FinishReason) -> None:
        """A bare final output: no tokens (offset 0 clears them), only the error."""
        self.pending.append(error_output(rid, prompt_tokens, reason))

    def send(self, send, outputs: List[ReqOutput], stats) -> List[Tuple[ReqOutput, Exception]]:
        """`send(BatchOutput)` once; if the channel refuses it, each output alone (the gauges
        with the first). Returns the outputs it still refused, with why."""
        try:
            if self.faults is not None:
                self.faults.check_any(Stage.SEND, [o.rid for o in outputs], spend=False)
            send(BatchOutput(outputs, stats))
            return []
        except Exception:
            logger.exception("sending a batch of %d outputs failed; sending them one by one", len(outputs))
        refused = []
        for i, out in enumerate(outputs):
            try:
                if self.faults is not None:
                    self.faults.check(Stage.SEND, out.rid)
                send(BatchOutput([out], stats if i == 0 else None))
            except Exception as e:
                refused.append((out, e))
        return refused

    def _delta(self, r) -> ReqOutput:
        if self.faults is not None:
            self.faults.check(Stage.OUTPUT, r.rid)
        return delta(r)

    def take(self) -> List[ReqOutput]:
        out, self.pending = self.pending, []
        return out


def _marks(n: int, interval: int) -> int:
    """How many lengths 1..n are sending points (i % interval == 1): ceil(n / interval)."""
    return -(-n // interval)


def error_output(rid: str, prompt_tokens: int, reason: FinishReason) -> ReqOutput:
    """A bare final output: no tokens (offset 0 clears them), only the error."""
    return ReqOutput(rid=rid, output_offset=0, output_ids=[], finished_reason=reason,
                     prompt_tokens=prompt_tokens, completion_tokens=0, cached_tokens=0)


def delta(r) -> ReqOutput:
    start = min(r.sent_output_len, r.first_changed)
    logprobs = _logprob_delta(r) if r.return_logprob else {}
    out = ReqOutput(
        rid=r.rid, output_offset=start, output_ids=r.output_ids[start:],
        finished_reason=r.finished_reason, prompt_tokens=r.prompt_len,
        completion_tokens=len(r.output_ids), cached_tokens=r.cached_tokens,
        num_retractions=r.num_retractions, spec=r.spec.as_tuple() if r.spec is not None else None,
        **logprobs)
    r.sent_output_len = r.first_changed = len(r.output_ids)
    return out


def _logprob_delta(r) -> dict:
    k = r.logprobs_sent
    d = dict(output_token_logprobs=r.output_token_logprobs[k:],
             output_top_logprobs=r.output_top_logprobs[k:],
             output_token_ids_logprobs=r.output_token_ids_logprobs[k:], logprob_offset=k)
    r.logprobs_sent = len(r.output_token_logprobs)
    if not r.input_logprobs_sent and (r.input_logprobs_done or r.finished):
        d.update(input_token_logprobs=r.input_token_logprobs, input_top_logprobs=r.input_top_logprobs,
                 input_token_ids_logprobs=r.input_token_ids_logprobs)
        r.input_logprobs_sent = True
    return d
