"""Every message between the server side (tokenizer manager) and the scheduler.

Small dataclasses, picklable, nothing else crosses the process boundary. The
in-process Engine passes the same objects through local queues.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from lmprog_runtime.sampling_params import SamplingParams

# One logprob entry: (logprob, token_id); the tokenizer manager adds the text.
LogprobEntry = Tuple[float, int]


# -- server → scheduler ---------------------------------------------------------------------
@dataclass
class TokenizedGenerateReq:
    rid: str
    input_ids: List[int]
    sampling_params: SamplingParams
    input_text: Optional[str] = None
    return_logprob: bool = False
    logprob_start_len: int = -1  # -1: output logprobs only
    top_logprobs_num: int = 0
    token_ids_logprob: Optional[List[int]] = None
    stream: bool = False
    cache_salt: Optional[str] = None
    extra_key: Optional[str] = None

    @property
    def namespace(self) -> Optional[tuple]:
        if self.cache_salt is None and self.extra_key is None:
            return None
        return (self.cache_salt, self.extra_key)


@dataclass
class AbortReq:
    rid: str = ""
    abort_all: bool = False
    message: str = "Aborted by client"


@dataclass
class FlushCacheReq:
    pass


@dataclass
class GetInternalStateReq:
    pass


@dataclass
class ShutdownReq:
    pass


# -- scheduler → server ---------------------------------------------------------------------
@dataclass
class ReqOutput:
    """What changed for one request in one step.

    `output_ids` replaces the request's output tokens from `output_offset` on (a
    jump-forward may rewrite the tail; normally `output_offset` is the old length).
    Logprob lists are deltas appended to what the client already has.
    """

    rid: str
    output_offset: int
    output_ids: List[int]
    finished_reason: Optional[Dict[str, Any]]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    num_retractions: int = 0
    logprob_offset: int = 0  # output logprob lists replace the client's from this index
    output_token_logprobs: List[LogprobEntry] = field(default_factory=list)
    output_top_logprobs: List[List[LogprobEntry]] = field(default_factory=list)
    output_token_ids_logprobs: List[List[LogprobEntry]] = field(default_factory=list)
    # Prompt-side logprobs arrive once, with the first output of the request.
    input_token_logprobs: Optional[List[Optional[LogprobEntry]]] = None
    input_top_logprobs: Optional[List[Optional[List[LogprobEntry]]]] = None
    input_token_ids_logprobs: Optional[List[Optional[List[LogprobEntry]]]] = None


@dataclass
class BatchOutput:
    outputs: List[ReqOutput]
    stats: Optional[Dict[str, Any]] = None  # scheduler gauges for /metrics, at most a few per second


@dataclass
class ControlReply:
    """Reply to a control request (flush, internal state)."""

    kind: str
    success: bool = True
    message: str = ""
    data: Dict[str, Any] = field(default_factory=dict)


@dataclass
class SchedulerReady:
    """First message from a scheduler: it has loaded the model."""

    info: Dict[str, Any]


@dataclass
class SchedulerFailed:
    """The scheduler hit an error it cannot recover from; it exits after sending this."""

    message: str
