"""The verbs of the language. Each builds an IR node; nothing here talks to a model."""

from __future__ import annotations

import inspect
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


# The keywords of gen_int and gen_string (SGLang's, in SGLang's positional order after
# `name`), defined once and passed on to `gen` by name.
TYPED_GEN_KEYS = ("max_tokens", "n", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k",
                  "min_p", "frequency_penalty", "presence_penalty", "ignore_eos", "return_logprob",
                  "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs")


def _typed_gen(dtype, fn_name: str, doc: str) -> Callable:
    def typed_gen(name=None, *args, **kwargs) -> Gen:
        if len(args) > len(TYPED_GEN_KEYS):
            raise TypeError(f"{fn_name}() takes at most {len(TYPED_GEN_KEYS) + 1} positional arguments")
        for key, value in zip(TYPED_GEN_KEYS, args):
            if key in kwargs:
                raise TypeError(f"{fn_name}() got multiple values for argument {key!r}")
            kwargs[key] = value
        unknown = sorted(set(kwargs) - set(TYPED_GEN_KEYS))
        if unknown:
            raise TypeError(f"{fn_name}() got unexpected keyword argument(s): {', '.join(unknown)}")
        return gen(name, dtype=dtype, **kwargs)

    params = [inspect.Parameter(k, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None)
              for k in ("name", *TYPED_GEN_KEYS)]
    typed_gen.__signature__ = inspect.Signature(params, return_annotation=Gen)
    typed_gen.__name__ = typed_gen.__qualname__ = fn_name
    typed_gen.__doc__ = doc
    return typed_gen


gen_int = _typed_gen(int, "gen_int", "`gen` constrained to an integer (the value is the digits as text; "
                                     "`int(s[name])` parses).")
gen_string = _typed_gen(str, "gen_string", "`gen` constrained to a double-quoted string of word characters "
                                           "and spaces.")


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
