"""SamplingParams: SGLang's sampling surface, its defaults and its validation messages.

Built from a request's `sampling_params` dict at the boundary (`from_dict` rejects
unknown keys), checked against the vocabulary (`verify`), then normalized with the
tokenizer (`normalize`). After that the object travels unchanged to the scheduler.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Union

TOP_K_ALL = 1 << 30
MAX_STOP_STRINGS = 32
LOGIT_BIAS_BOUND = 100.0                      # OpenAI's documented range
# logits / penalty must stay finite in float32 (1e-300 made inf -> nan probabilities)
MIN_REPETITION_PENALTY = 1e-6
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 63) - 1  # torch.Generator.manual_seed takes 64 bits; + n - 1 stays inside
_GREEDY_EPS = 1e-6


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    stop: Optional[Union[str, List[str]]] = None
    stop_token_ids: Optional[List[int]] = None
    stop_regex: Optional[Union[str, List[str]]] = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = TOP_K_ALL
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    n: int = 1
    json_schema: Optional[str] = None
    regex: Optional[str] = None
    ebnf: Optional[str] = None
    structural_tag: Optional[str] = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    stream_interval: Optional[int] = None
    logit_bias: Optional[Dict[str, float]] = None
    sampling_seed: Optional[int] = None
    custom_params: Optional[dict] = None
    # derived by normalize()
    stop_strs: List[str] = field(default_factory=list)
    stop_str_max_len: int = 0
    stop_regex_strs: List[str] = field(default_factory=list)

    _PUBLIC = (
        "max_new_tokens", "min_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p",
        "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "n",
        "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
        "spaces_between_special_tokens", "no_stop_trim", "stream_interval", "logit_bias",
        "sampling_seed", "custom_params",
    )

    @classmethod
    def from_dict(cls, d: Optional[dict]) -> "SamplingParams":
        """Build from a request dict; unknown keys are an error, None means 'default'."""
        d = dict(d or {})
        if "seed" in d and "sampling_seed" not in d:  # OpenAI-style alias
            d["sampling_seed"] = d.pop("seed")
        unknown = sorted(k for k in d if k not in cls._PUBLIC)
        if unknown:
            raise ValueError(f"Unknown sampling parameter(s): {', '.join(unknown)}.")
        params = cls(**{k: v for k, v in d.items() if v is not None})
        params._check_types()
        params._post_init()
        return params

    def _check_types(self):
        for name in ("max_new_tokens", "min_new_tokens", "top_k", "n"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                if isinstance(value, float) and value.is_integer():
                    setattr(self, name, int(value))
                else:
                    raise ValueError(f"{name} must be an integer, got {value!r}.")
        for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
                     "repetition_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{name} must be a number, got {value!r}.")
            setattr(self, name, float(value))
        if self.stop is not None and not isinstance(self.stop, (str, list)):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}.")
        if isinstance(self.stop, list) and not all(isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}.")
        if self.stop_regex is not None and not (
                isinstance(self.stop_regex, str)
                or (isinstance(self.stop_regex, list) and all(isinstance(x, str) for x in self.stop_regex))):
            raise ValueError(f"stop_regex must be a string or a list of strings, got {self.stop_regex!r}.")
        if self.stop_token_ids is not None:
            ids = self.stop_token_ids
            if not isinstance(ids, (list, tuple, set)) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in ids
            ):
                raise ValueError(f"stop_token_ids must be a list of integers, got {ids!r}.")
            self.stop_token_ids = sorted(set(ids))
        self._check_scheduler_inputs()
        for name in ("json_schema", "regex", "ebnf", "structural_tag"):
            value = getattr(self, name)
            if isinstance(value, dict) and name == "json_schema":
                import json
                self.json_schema = json.dumps(value)
            elif value is not None and not isinstance(value, str):
                raise ValueError(f"{name} must be a string, got {type(value).__name__}.")

    def _check_scheduler_inputs(self):
        """Values the scheduler uses without a second look (a bad one would crash its loop)."""
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}.")
        bias = self.logit_bias
        if bias is not None:
            if not isinstance(bias, dict):
                raise ValueError(f"logit_bias must be an object mapping token ids to floats, got {bias!r}.")
            for key, value in bias.items():
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                        math.isfinite(value) and abs(value) <= LOGIT_BIAS_BOUND):
                    raise ValueError(f"logit_bias[{key!r}] must be a finite number in "
                                     f"[-{LOGIT_BIAS_BOUND:g}, {LOGIT_BIAS_BOUND:g}], got {value!r}.")
        seed = self.sampling_seed
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not SEED_MIN <= seed <= SEED_MAX):
            raise ValueError(f"sampling_seed must be an integer in [{SEED_MIN}, {SEED_MAX}], got {seed!r}.")
        si = self.stream_interval
        if si is not None and (isinstance(si, bool) or not isinstance(si, int) or si < 1):
            raise ValueError(f"stream_interval must be an integer of at least 1, got {si!r}.")
        if self.custom_params is not None and not isinstance(self.custom_params, dict):
            raise ValueError(f"custom_params must be an object, got {self.custom_params!r}.")

    def _post_init(self):
        for name in ("json_schema", "regex", "ebnf", "structural_tag"):
            if getattr(self, name) == "":
                setattr(self, name, None)
        if self.top_k == -1:
            self.top_k = TOP_K_ALL

    @property
    def is_greedy(self) -> bool:
        return 0 <= self.temperature < _GREEDY_EPS or self.top_k == 1

    @property
    def grammar(self) -> Optional[tuple]:
        """(kind, spec) of the output constraint, or None."""
        for kind, attr in (("json", "json_schema"), ("regex", "regex"), ("ebnf", "ebnf"),
                           ("structural_tag", "structural_tag")):
            value = getattr(self, attr)
            if value is not None:
                return kind, value
        return None

    def verify(self, vocab_size: int) -> None:
        """Raise ValueError with SGLang's message for any out-of-range value."""
        t = self.temperature
        if not (math.isfinite(t) and t >= 0):
            raise ValueError(f"temperature must be a non-negative finite number, got {t}.")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.top_k < 1:
            raise ValueError(f"top_k must be -1 (disable) or at least 1, got {self.top_k}.")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value}.")
        if not 0 < self.repetition_penalty <= 2:
            raise ValueError(
                f"repetition_penalty must be in (0, 2] (1.0 = no penalty), got {self.repetition_penalty}.")
        if self.repetition_penalty < MIN_REPETITION_PENALTY:
            raise ValueError(f"repetition_penalty must be at least {MIN_REPETITION_PENALTY:g} (smaller values "
                             f"overflow the logits), got {self.repetition_penalty}.")
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be at least 0, got {self.max_new_tokens}.")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens must be in [0, max_new_tokens({self.max_new_tokens})], "
                f"got {self.min_new_tokens}.")
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")
        if self.logit_bias:
            for key in self.logit_bias:
                try:
                    token = int(key)
                except (TypeError, ValueError):
                    raise ValueError(f"logit_bias must has keys in [0, {vocab_size - 1}], got {key}.") from None
                if not 0 <= token < vocab_size:
                    raise ValueError(f"logit_bias must has keys in [0, {vocab_size - 1}], got {key}.")
        for token in self.stop_token_ids or ():
            if not 0 <= token < vocab_size:
                raise ValueError(f"stop_token_ids must be in [0, {vocab_size - 1}], got {token}.")
        if sum(x is not None for x in (self.json_schema, self.regex, self.ebnf, self.structural_tag)) > 1:
            raise ValueError("Only one of json_schema, regex, ebnf, or structural_tag can be set.")
        if self.regex is not None:
            try:  # the accepted dialect: Python's `re` syntax (no \p{..} classes, no `a**`)
                re.compile(self.regex)
            except (re.error, RecursionError, OverflowError) as e:
                raise ValueError(f"Failed to compile regex grammar: regex must be a valid Python regular "
                                 f"expression (the accepted dialect): {e}") from None

    def normalize(self, tokenizer) -> None:
        """Resolve stop strings to a list and measure their longest token length."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        stops = [s for s in stops if s]
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}")
        self.stop_strs = stops
        self.stop_str_max_len = max(
            (len(tokenizer.encode(s, add_special_tokens=False)) for s in stops), default=0)
        patterns = [self.stop_regex] if isinstance(self.stop_regex, str) else list(self.stop_regex or [])
        if len(patterns) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop_regex patterns are allowed, got {len(patterns)}")
        for pattern in patterns:
            if len(pattern.encode()) > 256:
                raise ValueError(f"each stop_regex pattern must be at most 256 bytes, got {len(pattern.encode())}")
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"invalid stop_regex {pattern!r}: {e}") from None
        self.stop_regex_strs = patterns

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self._PUBLIC}

    def clone(self) -> "SamplingParams":
        return dataclasses.replace(self, stop_strs=list(self.stop_strs),
                                   stop_regex_strs=list(self.stop_regex_strs))
