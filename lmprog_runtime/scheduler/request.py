"""Req: one request's state inside the scheduler.

Counters are stored, everything else derived: the tokens to compute next are
`fill_ids[kv_len:]`; positions [0, cache_protected_len) of its KV belong to the
radix tree (locked through `last_node`), positions [cache_protected_len, kv_len)
belong to the request and are freed or handed to the tree when it finishes.
Only `KVManager` writes the KV fields (row, kv_len, cache_protected_len, last_node).

The message it was built from is shared with the server side (in the Engine, the very
same object) and is never modified: the limits this scheduler clamps live here
(`max_new_tokens`, `min_new_tokens`, set by `Admission.clamp`).
"""

from __future__ import annotations

import time
from typing import List, Optional

import torch

from lmprog_runtime.messages import FinishReason, TokenizedGenerateReq


class SpecCounts:
    """Speculative decoding of one request (meta_info's spec_* fields)."""

    __slots__ = ("verify_ct", "draft_tokens", "accepted_tokens")

    def __init__(self):
        self.verify_ct = 0        # verify steps this request took part in
        self.draft_tokens = 0     # draft tokens proposed for it
        self.accepted_tokens = 0  # of those, accepted

    def as_tuple(self):
        return (self.verify_ct, self.draft_tokens, self.accepted_tokens)


class Req:
    def __init__(self, msg: TokenizedGenerateReq):
        self.rid = msg.rid
        self.origin_input_ids: List[int] = list(msg.input_ids)
        self.sampling = msg.sampling_params
        self.namespace = msg.namespace
        self.return_logprob = msg.return_logprob
        self.logprob_start_len = msg.logprob_start_len
        self.top_logprobs_num = msg.top_logprobs_num
        self.token_ids_logprob = msg.token_ids_logprob
        self.stream = msg.stream
        self.bootstrap = msg.bootstrap  # disaggregation: the prefill server and room (None: colocated)
        self.created = time.monotonic()
        # limits, clamped to what the context and the pool can hold on arrival
        self.max_new_tokens: int = self.sampling.max_new_tokens
        self.min_new_tokens: int = self.sampling.min_new_tokens

        self.output_ids: List[int] = []
        self.finished_reason: Optional[FinishReason] = None
        # KV bookkeeping
        self.row: Optional[int] = None  # ReqToTokenPool row, None while it holds no KV
        self.kv_len = 0
        self.cache_protected_len = 0
        self.last_node = None
        self.cached_tokens = 0  # reported: prompt tokens served from the cache, first admission
        self.tier_hits = (0, 0, 0)  # of the last match: tokens found on (device, host, storage)
        self.num_retractions = 0
        self.kv_suspect = False  # failed mid-step (faults.fail_request): free its KV, never cache it
        # output bookkeeping
        self.sent_output_len = 0  # output tokens the client has seen
        self.first_changed = 0  # lowest output index rewritten since the last send
        self.input_logprobs_done = False  # all asked-for prompt positions are scored
        self.input_logprobs_sent = False
        self.input_token_logprobs: List = []
        self.input_top_logprobs: List = []
        self.input_token_ids_logprobs: List = []
        self.output_token_logprobs: List = []
        self.output_top_logprobs: List = []
        self.output_token_ids_logprobs: List = []
        self.logprobs_sent = 0
        self.detok = None  # IncrementalDetokenizer of output_ids, made when a stop regex needs text
        self.spec: Optional[SpecCounts] = None  # set by the scheduler when speculation is on
        # constrained decoding
        self.grammar = None
        self.grammar_future = None
        self.generator: Optional[torch.Generator] = None
        if self.sampling.sampling_seed is not None:
            self.generator = torch.Generator().manual_seed(self.sampling.sampling_seed)

    # -- derived ---------------------------------------------------------------------------
    @property
    def fill_ids(self) -> List[int]:
        return self.origin_input_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def extend_len(self) -> int:
        return self.seq_len - self.kv_len

    @property
    def prompt_len(self) -> int:
        return len(self.origin_input_ids)

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    @property
    def wants_input_logprobs(self) -> bool:
        return (self.return_logprob and not self.input_logprobs_done
                and 0 <= self.logprob_start_len < self.prompt_len)

    def finish(self, reason: FinishReason) -> None:
        """The first reason wins (an abort during a step beats the step's own stop)."""
        if self.finished_reason is None:
            self.finished_reason = reason

    def __repr__(self) -> str:
        return (f"Req(rid={self.rid!r}, prompt={self.prompt_len}, out={len(self.output_ids)}, "
                f"kv={self.kv_len}, protected={self.cache_protected_len})")
