"""The scheduling limits of one server, derived once (see the table in admission.py).

Torch-free on purpose: the server process checks requests against the same numbers
(`AdmissionLimits.output_room`) that the scheduler admits them with; the scheduler sends
its limits in `SchedulerReady`.
"""

from __future__ import annotations

from dataclasses import dataclass

NEW_TOKEN_CLIP = 4096  # reserved output room per request is capped at this many tokens
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14  # the ratio decays to at least init * this
NEW_TOKEN_RATIO_DECAY_STEPS = 600  # ... over this many decode steps
RETRACT_DECODE_STEPS = 20  # after a retraction, reserve room for this many more steps each
DECODE_LIKE_EXTEND = 16  # a running request with fewer pending tokens is never budget-limited
INPUT_HEADROOM = 5  # a prompt leaves at least this many positions of max_req_len for output
DEFAULT_CHUNK_TOKENS = 512


@dataclass(frozen=True)
class AdmissionLimits:
    pool_tokens: int
    page_size: int
    context_len: int
    max_req_len: int
    max_req_input_len: int
    max_running: int
    chunk_tokens: int
    max_prefill_tokens: int
    init_ratio: float

    @classmethod
    def derive(cls, args, pool_tokens: int, pool_rows: int, context_len: int) -> "AdmissionLimits":
        """The one place the scheduling limits are computed. The runner has already sized
        the pools (`pool_tokens` slots, `pool_rows` rows: --max-total-tokens,
        --max-running-requests) and the context (--context-length over the model's)."""
        max_req_len = min(context_len - 1, pool_tokens - 1)
        return cls(pool_tokens=pool_tokens, page_size=args.page_size, context_len=context_len,
                   max_req_len=max_req_len, max_req_input_len=max_req_len - INPUT_HEADROOM,
                   max_running=pool_rows,
                   chunk_tokens=args.chunked_prefill_size or DEFAULT_CHUNK_TOKENS,
                   max_prefill_tokens=args.max_prefill_tokens,
                   init_ratio=min(INIT_NEW_TOKEN_RATIO * args.schedule_conservativeness, 1.0))

    def round_up(self, tokens: int) -> int:
        return -(-tokens // self.page_size) * self.page_size

    def output_room(self, prompt_len: int) -> int:
        """Most output tokens a prompt of this length can have: the context allows
        max_req_len - L - 1; the pool, after the prompt's pages and one spare page, the rest."""
        pool_room = self.pool_tokens - self.round_up(prompt_len) - self.page_size - 1
        return max(0, min(self.max_req_len - prompt_len - 1, pool_room))
