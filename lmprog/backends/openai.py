"""`OpenAI`: any server that speaks the OpenAI API (`/v1/chat/completions`, `/v1/completions`).

What it can do depends on the API, and it says so instead of guessing:
- chat models generate one whole assistant turn: `gen` must come right after the
  assistant role begins, and `select` is unavailable (the chat API returns no prompt
  logprobs);
- completion models generate from the raw text, and `select` scores each choice from
  echoed prompt logprobs (`echo=True, logprobs=1`), where the server supports them;
- `regex` travels as the `regex` extra field (lmprog_runtime and SGLang accept it);
  `json_schema` travels as `response_format`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import List, Optional

from lmprog.backends.base import BaseBackend
from lmprog.chat_template import ChatTemplate, get_chat_template_by_model_path
from lmprog.choices import ChoicesDecision, ChoicesSamplingMethod, token_length_normalized
from lmprog.ir import SamplingParams


@dataclass
class TokenUsage:
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def reset(self):
        self.prompt_tokens = self.completion_tokens = 0


class OpenAI(BaseBackend):
    def __init__(self, model_name: str, is_chat_model: Optional[bool] = None,
                 chat_template: Optional[ChatTemplate] = None, is_azure: bool = False, *,
                 client=None, **client_kwargs):
        super().__init__()
        self.model_name = model_name
        self.is_chat_model = ("instruct" not in model_name) if is_chat_model is None else is_chat_model
        self.chat_template = chat_template or get_chat_template_by_model_path(model_name)
        self.token_usage = TokenUsage()
        if client is None:
            import openai
            client_kwargs.setdefault("api_key", os.environ.get("OPENAI_API_KEY", "EMPTY"))
            client = (openai.AzureOpenAI if is_azure else openai.OpenAI)(**client_kwargs)
        self.client = client

    def get_model_name(self) -> str:
        return self.model_name

    # --- generate -------------------------------------------------------------------------
    def _kwargs(self, sp: SamplingParams, chat: bool) -> dict:
        kwargs = sp.to_openai_kwargs()
        extra = {}
        if sp.regex is not None:
            extra["regex"] = sp.regex
        if sp.top_k is not None and sp.top_k != -1:
            extra["top_k"] = sp.top_k
        if sp.min_new_tokens:
            extra["min_tokens"] = sp.min_new_tokens
        if sp.json_schema is not None:
            if chat:
                kwargs["response_format"] = {"type": "json_schema", "json_schema": {
                    "name": "output", "schema": json.loads(sp.json_schema)}}
            else:
                extra["json_schema"] = sp.json_schema
        if extra:
            kwargs["extra_body"] = extra
        return kwargs

    def _check_chat_position(self, s) -> None:
        if s.cur_role != "assistant" or s.text_[s.cur_role_begin_pos:].strip():
            raise RuntimeError(
                f"{self.model_name} is a chat model: the chat API generates a whole assistant turn, so "
                "gen() must come right after the assistant role begins (s += assistant(gen(...))). "
                "Use a completion model or RuntimeEndpoint for gens elsewhere.")

    def _create(self, s, sp: SamplingParams, stream: bool = False):
        if self.is_chat_model:
            self._check_chat_position(s)
            return self.client.chat.completions.create(model=self.model_name, messages=[dict(m) for m in s.messages_],
                                                       stream=stream, **self._kwargs(sp, chat=True))
        return self.client.completions.create(model=self.model_name, prompt=s.text_, stream=stream,
                                              **self._kwargs(sp, chat=False))

    def _text_of(self, choice) -> str:
        return (choice.message.content or "") if self.is_chat_model else choice.text

    def generate(self, s, sampling_params: SamplingParams):
        resp = self._create(s, sampling_params)
        usage = getattr(resp, "usage", None)
        if usage is not None:
            self.token_usage.prompt_tokens += usage.prompt_tokens
            self.token_usage.completion_tokens += usage.completion_tokens
        texts = [self._text_of(c) for c in sorted(resp.choices, key=lambda c: c.index)]
        meta = {"id": resp.id, "finish_reason": resp.choices[0].finish_reason,
                "prompt_tokens": getattr(usage, "prompt_tokens", None),
                "completion_tokens": getattr(usage, "completion_tokens", None)}
        return (texts if len(texts) > 1 else texts[0]), meta

    def generate_stream(self, s, sampling_params: SamplingParams):
        meta = {}
        for event in self._create(s, sampling_params, stream=True):
            if getattr(event, "usage", None) is not None:
                meta = {"prompt_tokens": event.usage.prompt_tokens,
                        "completion_tokens": event.usage.completion_tokens}
            if not event.choices:
                continue
            choice = event.choices[0]
            chunk = (choice.delta.content or "") if self.is_chat_model else (choice.text or "")
            if choice.finish_reason is not None:
                meta = {**meta, "finish_reason": choice.finish_reason}
            yield chunk, dict(meta)

    # --- select ---------------------------------------------------------------------------
    def select(self, s, choices: List[str], temperature: float,
               choices_method: Optional[ChoicesSamplingMethod] = None) -> ChoicesDecision:
        if self.is_chat_model:
            raise NotImplementedError(
                f"select() is not available on the OpenAI chat API ({self.model_name}): it needs the "
                "logprobs of each choice's tokens as part of the prompt, which chat completions do not "
                "return. Use RuntimeEndpoint/Engine, or a completion model whose server supports "
                "echo=True with logprobs.")
        text = s.text_
        resp = self.client.completions.create(model=self.model_name, prompt=[text + c for c in choices],
                                              echo=True, logprobs=1, max_tokens=1, temperature=0)
        input_lps = []
        for choice, c in zip(sorted(resp.choices, key=lambda x: x.index), choices):
            logprobs = choice.logprobs
            if logprobs is None or not logprobs.tokens:
                raise NotImplementedError(
                    f"the server did not echo prompt logprobs for {self.model_name}; select() needs them.")
            input_lps.append(_window(logprobs.tokens, logprobs.token_logprobs, len(text), len(text + c)))
        normalized = [_mean([e[0] for e in entries]) for entries in input_lps]
        method = choices_method or token_length_normalized
        if method.requires_unconditional_logprobs:
            raise NotImplementedError(f"{method} needs unconditional token logprobs; the OpenAI backend "
                                      "cannot provide them. Use token_length_normalized.")
        return method(choices=choices, normalized_prompt_logprobs=normalized, input_token_logprobs=input_lps,
                      output_token_logprobs=[[] for _ in choices])


def _window(tokens, token_logprobs, start_char: int, end_char: int) -> list:
    """(logprob, None, token) for the tokens that overlap characters [start_char, end_char)."""
    out, pos = [], 0
    for token, logprob in zip(tokens, token_logprobs):
        token_end = pos + len(token)
        if token_end > start_char and pos < end_char and logprob is not None:
            out.append([logprob, None, token])
        pos = token_end
        if pos >= end_char:
            break
    return out


def _mean(values) -> float:
    return sum(values) / len(values) if values else float("-inf")
