"""A unit-test double: a `NativeBackend` whose "server" answers from a script and records requests.

It speaks the same payloads as `RuntimeEndpoint` (it subclasses the shared protocol
code), so tests see exactly what would go over the wire. Tokens are whitespace-led
words; completions come from `responder(prompt, sampling_params) -> str`, trimmed at
stop strings and `max_new_tokens` like a server would.
"""

from __future__ import annotations

import json
import re
import threading
import time
from typing import Callable, Dict, Optional

from lmprog.backends.native import NativeBackend
from lmprog.ir import REGEX_BOOL, REGEX_FLOAT, REGEX_INT, REGEX_STR

CHATML_JINJA = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
                "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                "{% endif %}")

_CANNED = {REGEX_INT: "42", REGEX_FLOAT: "3.5", REGEX_STR: '"Paris"', REGEX_BOOL: "True"}


def tokenize(text: str):
    return re.findall(r"\s*\S+|\s+", text)


def minimal_instance(schema: dict):
    """The smallest value that validates against a simple JSON schema."""
    if "enum" in schema:
        return schema["enum"][0]
    kind = schema.get("type", "object")
    if kind == "object":
        props = schema.get("properties", {})
        return {k: minimal_instance(props[k]) for k in schema.get("required", list(props))}
    return {"string": "x", "integer": 1, "number": 1.5, "boolean": True, "array": [], "null": None}[kind]


def default_responder(prompt: str, params: dict) -> str:
    if params.get("regex") in _CANNED:
        return _CANNED[params["regex"]]
    if params.get("json_schema"):
        return json.dumps(minimal_instance(json.loads(params["json_schema"])))
    return " scripted answer"


class ScriptedBackend(NativeBackend):
    def __init__(self, responder: Optional[Callable[[str, dict], str]] = None,
                 choice_scores: Optional[Dict[str, float]] = None, model_info: Optional[dict] = None,
                 delay: float = 0.0, fail: Optional[Callable[[dict], bool]] = None, **template_kwargs):
        self._info = model_info or {"model_path": "scripted/chatml-model", "chat_template": CHATML_JINJA}
        self.responder = responder or default_responder
        self.choice_scores = choice_scores or {}
        self.delay = delay
        self.fail = fail
        self._ids: Dict[str, int] = {}
        self._lock = threading.Lock()
        super().__init__(**template_kwargs)
        self.request_log = []

    # --- transport ------------------------------------------------------------------------
    def get_model_info(self) -> dict:
        return self._info

    def get_server_info(self) -> dict:
        return {"version": "scripted"}

    def flush_cache(self):
        return None

    def _generate(self, payload: dict):
        if self.fail is not None and self.fail(payload):
            raise RuntimeError("scripted failure")
        if self.delay:
            time.sleep(self.delay)
        prompts = payload.get("text", payload.get("input_ids"))
        if isinstance(prompts, list) and prompts and not isinstance(prompts[0], int):
            return [self._answer(p, payload) for p in prompts]
        n = payload.get("sampling_params", {}).get("n", 1)
        if n > 1:
            return [self._answer(prompts, payload) for _ in range(n)]
        return self._answer(prompts, payload)

    def _generate_stream(self, payload: dict):
        final = self._generate(payload)
        tokens = tokenize(final["text"])
        for i in range(1, len(tokens) + 1):
            meta = dict(final["meta_info"], completion_tokens=i)
            if "output_token_logprobs" in meta:
                meta["output_token_logprobs"] = meta["output_token_logprobs"][:i]
            yield {"text": "".join(tokens[:i]), "meta_info": meta}

    # --- the fake model -------------------------------------------------------------------
    def token_id(self, token: str) -> int:
        with self._lock:
            return self._ids.setdefault(token, len(self._ids) + 1)

    def _logprob(self, token: str) -> float:
        return self.choice_scores.get(token.strip(), -1.0)

    def _answer(self, prompt, payload: dict) -> dict:
        params = payload.get("sampling_params", {})
        tokens = tokenize(prompt) if isinstance(prompt, str) else [f"<{t}>" for t in prompt]
        completion = "" if params.get("max_new_tokens") == 0 else self.responder(prompt, params)
        completion, finish = self._trim(completion, params)
        out_tokens = tokenize(completion)
        meta = {"id": "scripted", "finish_reason": finish, "prompt_tokens": len(tokens),
                "completion_tokens": len(out_tokens), "cached_tokens": 0}
        if payload.get("return_logprob"):
            start = payload.get("logprob_start_len") or 0
            start = len(tokens) if start < 0 else start
            meta["input_token_logprobs"] = [
                [None if i == 0 else self._logprob(t), self.token_id(t), t] for i, t in enumerate(tokens)][start:]
            meta["output_token_logprobs"] = [[-0.5, self.token_id(t), t] for t in out_tokens]
        return {"text": completion, "output_ids": [self.token_id(t) for t in out_tokens], "meta_info": meta}

    def _trim(self, completion: str, params: dict):
        for stop in params.get("stop", []):
            if stop and stop in completion:
                return completion[: completion.index(stop)], {"type": "stop", "matched": stop}
        limit = params.get("max_new_tokens", 128)
        tokens = tokenize(completion)
        if len(tokens) > limit:
            return "".join(tokens[:limit]), {"type": "length", "length": limit}
        return completion, {"type": "stop", "matched": 0}
