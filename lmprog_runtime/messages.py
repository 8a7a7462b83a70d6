"""Every message between the server side (tokenizer manager) and the scheduler.

Small frozen dataclasses, picklable; nothing else crosses the process boundary. The
in-process Engine passes the same objects through local queues, so both sides may hold
one message at once: nobody mutates a message (or the lists and SamplingParams inside
it) after building it. The scheduler keeps its own clamped limits on `Req`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple, Union

from lmprog_runtime.sampling_params import SamplingParams

# One logprob entry: (logprob, token_id); the tokenizer manager adds the text.
LogprobEntry = Tuple[float, int]


# -- how a request ended ----------------------------------------------------------------------
@dataclass(frozen=True)
class FinishReason:
    """Why a request finished. `to_dict()` is SGLang's `meta_info.finish_reason`:
    {"type": "stop", "matched": str|int|None} | {"type": "length", "length": n} |
    {"type": "abort", "message", "status_code", "err_type"}.

    An abort with a `status_code` is an error: the request fails with that HTTP status;
    one without (a client abort) finishes normally with what was generated so far."""

    type: str  # "stop" | "length" | "abort"
    matched: Union[str, int, None] = None  # stop: the stop string / regex / token id; None = grammar end
    limit: int = 0  # length: the max_new_tokens that was reached
    message: str = ""
    status_code: Optional[int] = None
    err_type: Optional[str] = None

    @classmethod
    def stop(cls, matched: Union[str, int, None] = None) -> "FinishReason":
        return cls("stop", matched=matched)

    @classmethod
    def length(cls, n: int) -> "FinishReason":
        return cls("length", limit=n)

    @classmethod
    def abort(cls, message: str) -> "FinishReason":
        return cls("abort", message=message)

    @classmethod
    def error(cls, status: int, message: str, err_type: Optional[str] = None) -> "FinishReason":
        return cls("abort", message=message, status_code=status, err_type=err_type)

    @property
    def is_error(self) -> bool:
        return self.type == "abort" and self.status_code is not None

    @property
    def is_abort(self) -> bool:
        return self.type == "abort"

    @property
    def matched_token(self) -> bool:
        """Stopped on a token id (an EOS or a stop token), which the text omits."""
        return self.type == "stop" and isinstance(self.matched, int)

    @property
    def matched_str(self) -> Optional[str]:
        return self.matched if self.type == "stop" and isinstance(self.matched, str) else None

    def to_dict(self) -> Dict[str, Any]:
        if self.type == "stop":
            return {"type": "stop", "matched": self.matched}
        if self.type == "length":
            return {"type": "length", "length": self.limit}
        return {"type": "abort", "message": self.message, "status_code": self.status_code,
                "err_type": self.err_type}


# -- server → scheduler ---------------------------------------------------------------------
@dataclass(frozen=True)
class Bootstrap:
    """Prefill/decode disaggregation: where the prefill half of a request runs (its bootstrap
    server) and the room that pairs the prefill and decode halves."""

    host: str
    port: int
    room: int  # in [0, 2^63)
    pair_key: Optional[str] = None

    @property
    def addr(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True)
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
    bootstrap: Optional[Bootstrap] = None  # set on both halves of a disaggregated request

    @property
    def namespace(self) -> Optional[tuple]:
        if self.cache_salt is None and self.extra_key is None:
            return None
        return (self.cache_salt, self.extra_key)


@dataclass(frozen=True)
class AbortReq:
    rid: str = ""
    abort_all: bool = False
    message: str = "Aborted by client"


@dataclass(frozen=True)
class FlushCacheReq:
    pass


@dataclass(frozen=True)
class GetInternalStateReq:
    pass


@dataclass(frozen=True)
class FreezeGcReq:
    """Collect, then freeze the scheduler process's live objects (gc_tuning.py)."""


# The Inspector's snapshot (scheduler/inspect.py); answered by ControlReply("inspect").
INSPECT_MAX_NODES_DEFAULT = 2000  # radix tree nodes in one snapshot, unless asked otherwise
INSPECT_MAX_NODES_CAP = 20000     # the most a client may ask for


@dataclass(frozen=True)
class InspectReq:
    max_nodes: int = INSPECT_MAX_NODES_DEFAULT
    include_tree: bool = True  # False: skip the tree walk (O(nodes)); the page asks less often for it
    kind: str = "inspect"


@dataclass(frozen=True)
class ShutdownReq:
    pass


@dataclass(frozen=True)
class EmbedReq:
    """Embeddings of token prompts (answered by ControlReply("embed", data={"embeddings"}))."""

    prompts: List[List[int]]
    pooling: str = "last"  # "last" | "mean"
    kind: str = "embed"


# The RL hooks (scheduler/weights.py); each is answered by a ControlReply of its `kind`.
MEMORY_TAGS = ("weights", "kv_cache")


@dataclass(frozen=True)
class UpdateWeightsReq:
    """Load new weights from `model_path` in place (idle only); flushes the prefix cache."""

    model_path: str
    weight_version: Optional[str] = None  # None: the number of updates so far, as a string
    kind: str = "update_weights"


@dataclass(frozen=True)
class MemoryOccupationReq:
    """Free (`release`) or re-create the weights and/or the KV tensors (idle only)."""

    release: bool
    tags: Tuple[str, ...] = MEMORY_TAGS

    @property
    def kind(self) -> str:
        return "release_memory" if self.release else "resume_memory"


@dataclass(frozen=True)
class HiCacheStorageReq:
    """Attach / detach HiCache's L3 storage backend (idle only), or show it (cache/storage_control.py);
    answered by ControlReply("hicache_storage")."""

    op: str                               # "attach" | "detach" | "status"
    backend: Optional[str] = None         # attach: "file" | "mooncake"
    extra_config: Optional[str] = None    # attach: JSON object text (--hicache-storage-backend-extra-config)
    prefetch_policy: Optional[str] = None  # attach: None keeps the current one
    storage_dir: Optional[str] = None     # attach, file backend: None keeps --hicache-storage-dir
    kind: str = "hicache_storage"


# -- scheduler → server ---------------------------------------------------------------------
@dataclass(frozen=True)
class ReqOutput:
    """What changed for one request in one step.

    `output_ids` replaces the request's output tokens from `output_offset` on (a
    jump-forward may rewrite the tail; normally `output_offset` is the old length).
    Logprob lists are deltas appended to what the client already has.
    """

    rid: str
    output_offset: int
    output_ids: List[int]
    finished_reason: Optional[FinishReason]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    num_retractions: int = 0
    # speculative decoding (None when off): (verify steps, draft tokens proposed, accepted)
    spec: Optional[Tuple[int, int, int]] = None
    logprob_offset: int = 0  # output logprob lists replace the client's from this index
    output_token_logprobs: List[LogprobEntry] = field(default_factory=list)
    output_top_logprobs: List[List[LogprobEntry]] = field(default_factory=list)
    output_token_ids_logprobs: List[List[LogprobEntry]] = field(default_factory=list)
    # Prompt-side logprobs arrive once, with the first output of the request.
    input_token_logprobs: Optional[List[Optional[LogprobEntry]]] = None
    input_top_logprobs: Optional[List[Optional[List[LogprobEntry]]]] = None
    input_token_ids_logprobs: Optional[List[Optional[List[LogprobEntry]]]] = None


@dataclass(frozen=True)
class BatchOutput:
    outputs: List[ReqOutput]
    stats: Optional[Dict[str, Any]] = None  # scheduler gauges for /metrics, at most a few per second


@dataclass(frozen=True)
class ControlReply:
    """Reply to a control request (flush, internal state)."""

    kind: str
    success: bool = True
    message: str = ""
    data: Dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SchedulerReady:
    """First message from a scheduler: it has loaded the model."""

    info: Dict[str, Any]


@dataclass(frozen=True)
class SchedulerFailed:
    """The scheduler hit an error it cannot recover from; it exits after sending this."""

    message: str
