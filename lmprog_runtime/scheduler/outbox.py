"""Outbox: the deltas (`ReqOutput`) a step produces for the tokenizer manager.

A delta carries what the client has not seen: output tokens from the lowest index
rewritten since the last send (a jump-forward may rewrite the tail) and the new
logprob entries. Building a delta advances the request's "sent" marks.
"""

from __future__ import annotations

from typing import List

from lmprog_runtime.messages import ReqOutput


class Outbox:
    def __init__(self, stream_interval: int):
        self.stream_interval = stream_interval  # server default; a request may set its own
        self.pending: List[ReqOutput] = []

    def stream(self, r) -> None:
        """A running streamed request produced tokens: send every `interval`-th step."""
        if r.finished or not r.stream:
            return
        interval = r.sampling.stream_interval or self.stream_interval
        if interval == 1 or len(r.output_ids) % interval == 1:
            self.pending.append(delta(r))

    def final(self, r) -> None:
        self.pending.append(delta(r))

    def take(self) -> List[ReqOutput]:
        out, self.pending = self.pending, []
        return out


def delta(r) -> ReqOutput:
    start = min(r.sent_output_len, r.first_changed)
    logprobs = _logprob_delta(r) if r.return_logprob else {}
    out = ReqOutput(
        rid=r.rid, output_offset=start, output_ids=r.output_ids[start:],
        finished_reason=r.finished_reason, prompt_tokens=r.prompt_len,
        completion_tokens=len(r.output_ids), cached_tokens=r.cached_tokens,
        num_retractions=r.num_retractions, **logprobs)
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
