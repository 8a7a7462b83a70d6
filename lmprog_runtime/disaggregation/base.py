"""The contracts of prefill/decode disaggregation (SGLang's roles, lmprog's code).

    KVManager        one per scheduler: owns the transfer engine, the pool's registered
                     memory and the control endpoint (a ZMQ PULL socket) peers talk to
    KVSender         prefill side, one per request: waits for the decode side's handshake,
                     ships finished pages (`send`), then the metadata of the first token
    KVReceiver       decode side, one per request: finds the prefill server through its
                     bootstrap server, sends where the pages go (`send_metadata`), waits
    BootstrapServer  in the prefill server: which KV endpoint serves a bootstrap address

States (`KVPoll`, SGLang's numbers) run Bootstrapping → WaitingForInput → Transferring →
Success; any of them may become Failed (the peer died, a timeout, an abort), which is final.

The control messages below cross the wire pickled over ZMQ (both ends run lmprog); the KV
bytes themselves move through the transfer backend (mooncake: one-sided writes into the
decode pool's registered memory; fake: not at all).
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional


class KVPoll(enum.IntEnum):
    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


@dataclass(frozen=True)
class PoolLayout:
    """Where slot `s` of layer `l` lives in a pool: `k_ptr + (l * rows + s) * slot_bytes`
    (likewise `v_ptr`); `slot_bytes` = kv_heads * head_dim * element size."""

    k_ptr: int
    v_ptr: int
    rows: int         # slots per layer, padding page included
    num_layers: int
    slot_bytes: int
    page_size: int
    dtype: str

    def compatible(self, other: "PoolLayout") -> Optional[str]:
        """None when pages of `other`'s pool can be written into this one, else why not."""
        mine = (self.num_layers, self.slot_bytes, self.page_size, self.dtype)
        theirs = (other.num_layers, other.slot_bytes, other.page_size, other.dtype)
        if mine != theirs:
            return (f"KV layouts differ: (layers, slot bytes, page size, dtype) {theirs} on the decode "
                    f"server vs {mine} here")
        return None


@dataclass(frozen=True)
class TransferInfo:
    """decode → prefill, once per request: where its prompt's pages go. `dst_slots[i]` is the
    decode pool slot of prompt position `decode_prefix_len + i` (the decode server's radix
    cache already holds positions [0, decode_prefix_len), so those are not sent)."""

    room: int
    endpoint: str            # the decode manager's control endpoint (tcp://host:port)
    session_id: str          # the decode transfer engine's address (mooncake host:rpc_port)
    layout: PoolLayout
    dst_slots: List[int]
    decode_prefix_len: int


@dataclass(frozen=True)
class TransferAbort:
    """decode → prefill: the decode half of `room` ended (client abort, timeout). The prefill
    side answers with a failed TransferDone once it writes no more into the room's slots."""

    room: int
    message: str
    endpoint: str = ""  # the decode manager's control endpoint


@dataclass(frozen=True)
class TransferDone:
    """prefill → decode: the pages of `room` are written (`ok`), with the first token's
    metadata; or the prefill half failed (`ok` False, `message` says why)."""

    room: int
    ok: bool
    message: str = ""
    meta: Dict[str, Any] = field(default_factory=dict)  # first_token, cached_tokens, logprob entries
    bytes_sent: int = 0
    transfer_s: float = 0.0


class BaseKVSender(ABC):
    @abstractmethod
    def poll(self) -> KVPoll: ...

    @abstractmethod
    def send(self, src_slots: List[int], start: int) -> None:
        """Write the pages of prompt positions [start, start + len(src_slots)) (`src_slots`:
        this pool's slots of them) into the decode pool; raises on a failed write."""

    @abstractmethod
    def finish(self, meta: Dict[str, Any]) -> None:
        """Everything is sent: tell the decode side, with the first token's metadata."""

    @abstractmethod
    def abort(self, message: str) -> None: ...


class BaseKVReceiver(ABC):
    @abstractmethod
    def poll(self) -> KVPoll: ...

    @abstractmethod
    def send_metadata(self, dst_slots: List[int], decode_prefix_len: int) -> None: ...

    @abstractmethod
    def abort(self, message: str) -> None: ...


class BaseKVManager(ABC):
    @abstractmethod
    def sender(self, bootstrap, prompt_len: int) -> BaseKVSender: ...

    @abstractmethod
    def receiver(self, bootstrap) -> BaseKVReceiver: ...

    @abstractmethod
    def close(self) -> None: ...


class BaseKVBootstrapServer(ABC):
    @abstractmethod
    def start(self) -> None: ...

    @abstractmethod
    def close(self) -> None: ...
