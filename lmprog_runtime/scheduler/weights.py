"""The RL hooks inside the scheduler: new weights from disk, and freeing / re-creating the
model's memory between rollouts. Both run only while no request is running or waiting
(the reply says so otherwise); both leave the prefix cache empty, since its KV no longer
matches the weights (or no longer exists).

While memory is released every new request fails at once with a 503.
"""

from __future__ import annotations

import logging
from typing import Optional

from lmprog_runtime.messages import ControlReply, FinishReason, MemoryOccupationReq, UpdateWeightsReq

logger = logging.getLogger(__name__)

BUSY = "requests are running or waiting; retry when the server is idle"


class WeightControl:
    def __init__(self, runner, kv):
        self.runner = runner
        self.kv = kv
        self.version = "default"  # meta_info.weight_version and /get_weight_version
        self.updates = 0
        self.released: tuple = ()  # the MEMORY_TAGS now freed

    def refusal(self) -> Optional[FinishReason]:
        """Why a new request cannot run now (None: it can)."""
        if not self.released:
            return None
        return FinishReason.error(503, f"The server's memory is released ({', '.join(self.released)}); "
                                       "POST /resume_memory_occupation first.", "ServiceUnavailable")

    def handle(self, msg, idle: bool) -> ControlReply:
        if not idle:
            return self._reply(msg.kind, False, f"Not done: {BUSY}.")
        try:
            if isinstance(msg, UpdateWeightsReq):
                return self._update(msg)
            return self._memory(msg)
        except Exception as e:  # a bad path or file: the request fails, the old state stays
            logger.exception("%s failed", msg.kind)
            return self._reply(msg.kind, False, f"{type(e).__name__}: {e}")

    def _update(self, msg: UpdateWeightsReq) -> ControlReply:
        if self.released:
            return self._reply(msg.kind, False, "The memory is released; resume it before updating weights.")
        self.runner.update_weights_from_disk(msg.model_path)
        self.kv.flush()
        self.updates += 1
        self.version = msg.weight_version or str(self.updates)
        return self._reply(msg.kind, True, f"Succeeded to update model weights from {msg.model_path}.")

    def _memory(self, msg: MemoryOccupationReq) -> ControlReply:
        weights, kv_cache = "weights" in msg.tags, "kv_cache" in msg.tags
        if msg.release:
            self.kv.flush()  # the cached prefixes' KV is about to go
            self.runner.release_memory(weights=weights, kv_cache=kv_cache)
            self.released = tuple(sorted(set(self.released) | set(msg.tags)))
        else:
            self.runner.resume_memory(weights=weights, kv_cache=kv_cache)
            self.released = tuple(t for t in self.released if t not in msg.tags)
        return self._reply(msg.kind, True, "ok")

    def _reply(self, kind: str, success: bool, message: str) -> ControlReply:
        return ControlReply(kind, success=success, message=message,
                            data={"weight_version": self.version, "released": list(self.released)})
