"""The SGLang-native `/generate` protocol, shared by the HTTP and in-process backends.

`NativeBackend` turns executor requests into `/generate` payloads and reads the
answers; a subclass supplies only the transport (`_generate`, `_generate_stream`,
`get_model_info`). Prefix-sharing hints are zero-token requests (`max_new_tokens: 0`):
the server prefills the text, caches its KV, and returns no tokens.
"""

from __future__ import annotations

from typing import Iterator, List, Optional

from lmprog.backends.base import BaseBackend
from lmprog.chat_template import ChatTemplate, chat_template_for_model
from lmprog.choices import ChoicesDecision, ChoicesSamplingMethod, token_length_normalized
from lmprog.global_config import global_config
from lmprog.ir import SamplingParams


class NativeBackend(BaseBackend):
    def __init__(self, chat_template_name: Optional[str] = None, chat_template: Optional[ChatTemplate] = None):
        super().__init__()
        #: when a list, every payload sent is appended to it (tests and debugging)
        self.request_log: Optional[list] = None
        self._streams_deltas: Optional[bool] = None
        self.model_info = self.get_model_info()
        self.chat_template = chat_template or chat_template_for_model(self.model_info, chat_template_name)

    # --- transport (subclasses) -----------------------------------------------------------
    def _generate(self, payload: dict):
        """The `/generate` answer: a dict, or a list of dicts for a batch payload."""
        raise NotImplementedError

    def _generate_stream(self, payload: dict) -> Iterator[dict]:
        """The decoded SSE `data:` objects of a streaming `/generate`, without `[DONE]`."""
        raise NotImplementedError

    def get_model_info(self) -> dict:
        raise NotImplementedError

    # --- requests -------------------------------------------------------------------------
    def _send(self, payload: dict):
        if self.request_log is not None:
            self.request_log.append(payload)
        result = self._generate(payload)
        for item in result if isinstance(result, list) else (result,):
            _raise_if_aborted(item)
        return result

    def get_model_name(self) -> str:
        return self.model_info.get("model_path", "")

    def _prefill(self, text: str) -> dict:
        return self._send({"text": text, "sampling_params": {"max_new_tokens": 0}})

    def cache_prefix(self, prefix_str: str) -> None:
        self._prefill(prefix_str)

    def commit_lazy_operations(self, s) -> None:
        self._prefill(s.text_)

    def generation_payload(self, text: str, sampling_params: SamplingParams) -> dict:
        params = {"skip_special_tokens": global_config.skip_special_tokens_in_output,
                  "spaces_between_special_tokens": global_config.spaces_between_special_tokens_in_out}
        params.update(sampling_params.to_runtime_dict())
        return {"text": text, "sampling_params": params, **sampling_params.logprob_fields()}

    def generate(self, s, sampling_params: SamplingParams):
        result = self._send(self.generation_payload(s.text_, sampling_params))
        if isinstance(result, list):  # n > 1: one item per sample
            return [r["text"] for r in result], [r["meta_info"] for r in result]
        return result["text"], result["meta_info"]

    def generate_stream(self, s, sampling_params: SamplingParams):
        if (sampling_params.n or 1) > 1:
            raise ValueError(f"streaming supports n=1 only, got n={sampling_params.n}.")
        payload = self.generation_payload(s.text_, sampling_params)
        payload["stream"] = True
        if self.request_log is not None:
            self.request_log.append(payload)
        deltas, seen, meta = self.streams_deltas(), "", {}
        for data in self._generate_stream(payload):
            if "error" in data:
                err = data["error"]
                raise RuntimeError(f"stream failed: {err.get('message', err) if isinstance(err, dict) else err}")
            _raise_if_aborted(data)
            text = data.get("text", "")
            if deltas:  # --incremental-streaming-output: text and output logprobs are per chunk
                chunk, seen, meta = text, seen + text, _accumulate(meta, data.get("meta_info") or {})
            elif text.startswith(seen):  # cumulative text (the default server mode)
                chunk, seen, meta = text[len(seen):], text, data.get("meta_info", {})
            else:  # cumulative text that changed behind us: send only what is new
                chunk, seen, meta = text, seen + text, data.get("meta_info", {})
            yield chunk, dict(meta)

    def streams_deltas(self) -> bool:
        """Whether the server streams deltas (`--incremental-streaming-output`); asked once.
        The executor always gets the cumulative meta_info, whichever the server sends."""
        if self._streams_deltas is None:
            try:
                info = self.get_server_info() or {}
            except Exception:  # a server without /get_server_info streams cumulatively (SGLang's default)
                info = {}
            self._streams_deltas = bool(info.get("incremental_streaming_output"))
        return self._streams_deltas

    # --- select ---------------------------------------------------------------------------
    def select(self, s, choices: List[str], temperature: float,
               choices_method: Optional[ChoicesSamplingMethod] = None) -> ChoicesDecision:
        if temperature > 1e-5:
            raise ValueError(f"select is greedy: temperature must be 0, got {temperature}.")
        method = choices_method or token_length_normalized
        text = s.text_
        # Prefill the shared context once; the choices then reuse its cached KV.
        prompt_len = self._prefill(text)["meta_info"]["prompt_tokens"]
        results = self._send({
            "text": [text + c for c in choices],
            "sampling_params": {"max_new_tokens": 0, "temperature": 0},
            "return_logprob": True, "return_text_in_logprobs": True,
            "logprob_start_len": max(prompt_len - 1, 0),
        })
        input_lps = [_choice_window(text, r["meta_info"]["input_token_logprobs"]) for r in results]
        output_lps = [r["meta_info"].get("output_token_logprobs", []) for r in results]
        normalized = [_mean_logprob(entries) for entries in input_lps]
        unconditional = None
        if method.requires_unconditional_logprobs:
            uncond = self._send({"input_ids": [[e[1] for e in entries] for entries in input_lps],
                                 "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
                                 "logprob_start_len": 0})
            unconditional = [r["meta_info"]["input_token_logprobs"] for r in uncond]
        return method(choices=choices, normalized_prompt_logprobs=normalized, input_token_logprobs=input_lps,
                      output_token_logprobs=output_lps, unconditional_token_logprobs=unconditional)


def _choice_window(text: str, entries) -> list:
    """The entries that score the choice: drop `None`s, and the last prompt token when it is intact.

    The window starts one token before the choice, so that a choice whose first token
    merged with the end of the prompt is still scored as a whole. When no merge
    happened, that first entry is the prompt's own last token and is dropped.
    """
    entries = [list(e) for e in entries if e[0] is not None]
    if len(entries) > 1 and entries[0][2] is not None and text.endswith(entries[0][2]):
        entries = entries[1:]
    return entries


def _mean_logprob(entries) -> float:
    values = [e[0] for e in entries if e[0] is not None]
    return sum(values) / len(values) if values else float("-inf")


# meta_info lists that an incremental server sends per chunk (the rest is cumulative anyway)
_OUTPUT_LISTS = ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs")


def _accumulate(total: dict, meta: dict) -> dict:
    """`total` (the cumulative meta_info so far) with one delta chunk's `meta` folded in."""
    out = dict(total)
    for key, value in meta.items():
        if key in _OUTPUT_LISTS and isinstance(value, list):
            out[key] = total.get(key, []) + value
        else:
            out[key] = value
    return out


def _raise_if_aborted(item: dict) -> None:
    finish = (item.get("meta_info") or {}).get("finish_reason")
    if isinstance(finish, dict) and finish.get("type") == "abort":
        raise RuntimeError(f"the server aborted the request: {finish.get('message', finish)}")
