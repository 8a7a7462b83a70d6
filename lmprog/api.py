"""The verbs of the language. Each builds an IR node; nothing here talks to a model."""

from __future__ import annotations

import re
from typing import Callable, List, Optional, Union

from lmprog.choices import ChoicesSamplingMethod, token_length_normalized
from lmprog.global_config import global_config
from lmprog.ir import (Expr, ExprList, Gen, Image, RoleBegin, RoleEnd, SamplingParams, Select,
                       SeparateReasoning, Video)
from lmprog.program import SglFunction


def function(func: Optional[Callable] = None, num_api_spec_tokens: Optional[int] = None):
    """`@function` or `@function(num_api_spec_tokens=...)`: turn `def prog(s, ...)` into a program."""
    if func is not None:
        return SglFunction(func, num_api_spec_tokens=num_api_spec_tokens)

    def decorator(f):
        return SglFunction(f, num_api_spec_tokens=num_api_spec_tokens)

    return decorator


def set_default_backend(backend) -> None:
    global_config.default_backend = backend


def _backend_or_default(backend):
    backend = backend or global_config.default_backend
    if backend is not None and hasattr(backend, "endpoint"):
        backend = backend.endpoint
    return backend


def flush_cache(backend=None):
    backend = _backend_or_default(backend)
    return False if backend is None else backend.flush_cache()


def get_server_info(backend=None):
    backend = _backend_or_default(backend)
    return None if backend is None else backend.get_server_info()


def gen(name: Optional[str] = None, max_tokens: Optional[int] = None, min_tokens: Optional[int] = None,
        n: Optional[int] = None, stop: Optional[Union[str, List[str]]] = None,
        stop_token_ids: Optional[List[int]] = None, stop_regex: Optional[Union[str, List[str]]] = None,
        temperature: Optional[float] = None, top_p: Optional[float] = None, top_k: Optional[int] = None,
        min_p: Optional[float] = None, frequency_penalty: Optional[float] = None,
        presence_penalty: Optional[float] = None, ignore_eos: Optional[bool] = None,
        return_logprob: Optional[bool] = None, logprob_start_len: Optional[int] = None,
        top_logprobs_num: Optional[int] = None, return_text_in_logprobs: Optional[bool] = None,
        dtype: Optional[Union[type, str]] = None, choices: Optional[List[str]] = None,
        choices_method: Optional[ChoicesSamplingMethod] = None, regex: Optional[str] = None,
        json_schema: Optional[str] = None) -> Expr:
    """Generate text into variable `name`. With `choices`, this is `select` (other options ignored)."""
    if choices:
        return Select(name, tuple(choices), 0.0 if temperature is None else temperature,
                      choices_method or token_length_normalized)
    if regex is not None:
        _check_regex(regex)
    return Gen(name, SamplingParams(
        max_new_tokens=max_tokens, min_new_tokens=min_tokens, n=n, stop=stop, stop_token_ids=stop_token_ids,
        stop_regex=stop_regex, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
        frequency_penalty=frequency_penalty, presence_penalty=presence_penalty, ignore_eos=ignore_eos,
        return_logprob=return_logprob, logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
        return_text_in_logprobs=return_text_in_logprobs, dtype=dtype, regex=regex, json_schema=json_schema))


def _check_regex(regex: str) -> None:
    if not isinstance(regex, str) or regex == "":
        raise ValueError(f"regex must be a non-empty pattern string, got {regex!r}.")
    re.compile(regex)  # re.error names the problem and its position


def _typed_gen(dtype, name, max_tokens, n, stop, stop_token_ids, stop_regex, temperature, top_p, top_k,
               min_p, frequency_penalty, presence_penalty, ignore_eos, return_logprob, logprob_start_len,
               top_logprobs_num, return_text_in_logprobs) -> Gen:
    return gen(name, max_tokens, None, n, stop, stop_token_ids, stop_regex, temperature, top_p, top_k, min_p,
               frequency_penalty, presence_penalty, ignore_eos, return_logprob, logprob_start_len,
               top_logprobs_num, return_text_in_logprobs, dtype=dtype)


def gen_int(name=None, max_tokens=None, n=None, stop=None, stop_token_ids=None, stop_regex=None,
            temperature=None, top_p=None, top_k=None, min_p=None, frequency_penalty=None,
            presence_penalty=None, ignore_eos=None, return_logprob=None, logprob_start_len=None,
            top_logprobs_num=None, return_text_in_logprobs=None) -> Gen:
    """`gen` constrained to an integer (the value is the digits as text; `int(s[name])` parses)."""
    return _typed_gen(int, name, max_tokens, n, stop, stop_token_ids, stop_regex, temperature, top_p, top_k,
                      min_p, frequency_penalty, presence_penalty, ignore_eos, return_logprob,
                      logprob_start_len, top_logprobs_num, return_text_in_logprobs)


def gen_string(name=None, max_tokens=None, n=None, stop=None, stop_token_ids=None, stop_regex=None,
               temperature=None, top_p=None, top_k=None, min_p=None, frequency_penalty=None,
               presence_penalty=None, ignore_eos=None, return_logprob=None, logprob_start_len=None,
               top_logprobs_num=None, return_text_in_logprobs=None) -> Gen:
    """`gen` constrained to a double-quoted string of word characters and spaces."""
    return _typed_gen(str, name, max_tokens, n, stop, stop_token_ids, stop_regex, temperature, top_p, top_k,
                      min_p, frequency_penalty, presence_penalty, ignore_eos, return_logprob,
                      logprob_start_len, top_logprobs_num, return_text_in_logprobs)


def select(name: Optional[str] = None, choices: Optional[List[str]] = None, temperature: float = 0.0,
           choices_method: ChoicesSamplingMethod = token_length_normalized) -> Select:
    """Pick one of `choices` by its likelihood after the current text; stored in `name`."""
    if not choices:
        raise ValueError(f"select() needs a non-empty list of choices, got {choices!r}.")
    if not all(isinstance(c, str) for c in choices):
        raise TypeError(f"select() choices must be strings, got {choices!r}.")
    return Select(name, tuple(choices), temperature, choices_method)


def image(expr) -> Image:
    return Image(expr)


def video(path: str, num_frames: int) -> Video:
    return Video(path, num_frames)


def _role(role: str, expr=None) -> ExprList:
    parts = [RoleBegin(role)] + ([expr] if expr is not None else []) + [RoleEnd(role)]
    return ExprList.concat(*parts)


def system(expr=None) -> ExprList:
    return _role("system", expr)


def user(expr=None) -> ExprList:
    return _role("user", expr)


def assistant(expr=None) -> ExprList:
    return _role("assistant", expr)


def system_begin() -> RoleBegin:
    return RoleBegin("system")


def system_end() -> RoleEnd:
    return RoleEnd("system")


def user_begin() -> RoleBegin:
    return RoleBegin("user")


def user_end() -> RoleEnd:
    return RoleEnd("user")


def assistant_begin() -> RoleBegin:
    return RoleBegin("assistant")


def assistant_end() -> RoleEnd:
    return RoleEnd("assistant")


def separate_reasoning(expr=None, model_type: Optional[str] = None) -> ExprList:
    """After `expr` (a named gen/select), split its value into `name` and `name_reasoning_content`."""
    target = _last_named(expr)
    if target is None:
        raise ValueError("name must be provided: separate_reasoning needs a named gen or select.")
    return ExprList.concat(expr, SeparateReasoning(model_type, expr, f"{target}_reasoning_content"))


def _last_named(expr) -> Optional[str]:
    if isinstance(expr, (Gen, Select)):
        return expr.name
    if isinstance(expr, ExprList):
        names = [n for n in (_last_named(e) for e in expr.exprs) if n is not None]
        return names[-1] if names else None
    return None
