"""The backend contract: what the stream executor asks of a model server.

`s` below is the executor of one program state; a backend reads `s.text_`
(the prompt so far), `s.messages_` (the chat so far) and `s.sid`, and never writes it.
Every method other than `generate`/`generate_stream`/`select` has a harmless default,
so a backend implements only what its server can do.
"""

from __future__ import annotations

from typing import Iterator, List, Optional, Tuple

from lmprog.chat_template import ChatTemplate, get_chat_template
from lmprog.choices import ChoicesDecision, ChoicesSamplingMethod
from lmprog.ir import SamplingParams


class BaseBackend:
    #: the backend can turn `join("concate_and_append")` into a KV-cache operation
    support_concate_and_append = False
    #: image/video inputs are accepted
    supports_images = False

    def __init__(self):
        self.chat_template: ChatTemplate = get_chat_template("default")

    # --- identity -------------------------------------------------------------------------
    def get_model_name(self) -> str:
        raise NotImplementedError(f"{type(self).__name__} does not know its model name.")

    def get_chat_template(self) -> ChatTemplate:
        return self.chat_template

    # --- prefix-sharing hints (no-ops where the server has no prefix cache) --------------
    def cache_prefix(self, prefix_str: str) -> None:
        """Warm the server's prefix cache with `prefix_str` (zero new tokens)."""

    def commit_lazy_operations(self, s) -> None:
        """Warm the server's prefix cache with the state's text so far."""

    def uncache_prefix(self, rid: str) -> None:
        pass

    def end_request(self, rid) -> None:
        pass

    # --- program lifecycle ----------------------------------------------------------------
    def begin_program(self, s) -> None:
        pass

    def end_program(self, s) -> None:
        pass

    def fork_program(self, src, dst, position_ids_offset=None) -> None:
        pass

    def fill_image(self, s) -> None:
        pass

    # --- model calls ----------------------------------------------------------------------
    def generate(self, s, sampling_params: SamplingParams) -> Tuple[object, dict]:
        """One completion of `s.text_`: (text, meta_info). With n > 1, text is a list."""
        raise NotImplementedError(f"{type(self).__name__} cannot generate.")

    def generate_stream(self, s, sampling_params: SamplingParams) -> Iterator[Tuple[str, dict]]:
        """Yield (new text, cumulative meta_info) chunks of one completion."""
        raise NotImplementedError(f"{type(self).__name__} cannot stream.")

    def select(self, s, choices: List[str], temperature: float,
               choices_method: Optional[ChoicesSamplingMethod] = None) -> ChoicesDecision:
        raise NotImplementedError(f"{type(self).__name__} cannot score choices (select).")

    def concatenate_and_append(self, src_rids: List[str], dst_rid: str) -> None:
        raise NotImplementedError(f"{type(self).__name__} cannot concatenate KV caches.")

    # --- server administration ------------------------------------------------------------
    def flush_cache(self):
        return None

    def get_server_info(self):
        return None

    def shutdown(self) -> None:
        pass
