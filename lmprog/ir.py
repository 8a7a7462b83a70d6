"""The immutable IR: expression nodes a program appends to its state, and `SamplingParams`.

Every node is a frozen dataclass. `+` with a `str` or another node builds a flat
`ExprList`; nothing ever mutates a node after construction, so a node can be shared
between states, forks and traced graphs freely.

`SamplingParams` is one frozen object for all sampling options. A field left at
`None` means "not set here": `gen(...)` builds a partial one, `run(...)` a complete
default, and `defaults.merged(partial)` resolves a gen field by field.
"""

from __future__ import annotations

import dataclasses
import itertools
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional, Tuple

# dtype -> (regex, extra stop strings). Regexes are SGLang's, so outputs parse the same way.
REGEX_INT = r"[-+]?[0-9]+[ \n]*"
REGEX_FLOAT = r"[-+]?[0-9]*\.?[0-9]+[ \n]*"
REGEX_BOOL = r"(True|False)"
REGEX_STR = r"\"[\w\d\s]*\""

_DTYPE_CONSTRAINTS = {
    "int": (REGEX_INT, (" ", "\n")),
    "float": (REGEX_FLOAT, (" ", "\n")),
    "str": (REGEX_STR, ()),
    "bool": (REGEX_BOOL, ()),
}


def dtype_name(dtype: Any) -> str:
    """`int` or "int" -> "int"; anything else is an error naming the accepted values."""
    name = dtype.__name__ if isinstance(dtype, type) else dtype
    if name not in _DTYPE_CONSTRAINTS:
        raise ValueError(f"dtype must be one of int, float, str, bool (type or name), got {dtype!r}.")
    return name


def _as_tuple(value) -> Optional[tuple]:
    if value is None:
        return None
    if isinstance(value, str):
        return (value,)
    return tuple(value)


@dataclass(frozen=True)
class SamplingParams:
    """All sampling options of one gen. `None` = unset (inherit from the defaults)."""

    max_new_tokens: Optional[int] = None
    min_new_tokens: Optional[int] = None
    n: Optional[int] = None
    stop: Optional[Tuple[str, ...]] = None
    stop_token_ids: Optional[Tuple[int, ...]] = None
    stop_regex: Optional[Tuple[str, ...]] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    frequency_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    ignore_eos: Optional[bool] = None
    return_logprob: Optional[bool] = None
    logprob_start_len: Optional[int] = None
    top_logprobs_num: Optional[int] = None
    return_text_in_logprobs: Optional[bool] = None
    dtype: Optional[str] = None
    regex: Optional[str] = None
    json_schema: Optional[str] = None

    def __post_init__(self):
        for name in ("stop", "stop_token_ids", "stop_regex"):
            object.__setattr__(self, name, _as_tuple(getattr(self, name)))
        if self.dtype is not None:
            object.__setattr__(self, "dtype", dtype_name(self.dtype))
        if self.json_schema is not None and not isinstance(self.json_schema, str):
            raise TypeError(f"json_schema must be a JSON string, got {type(self.json_schema).__name__}.")

    def merged(self, overlay: "SamplingParams") -> "SamplingParams":
        """Self with every field that `overlay` sets replaced by the overlay's value."""
        changes = {f.name: getattr(overlay, f.name) for f in dataclasses.fields(overlay)
                   if getattr(overlay, f.name) is not None}
        return dataclasses.replace(self, **changes)

    def with_extra_stops(self, stops) -> "SamplingParams":
        if not stops:
            return self
        return dataclasses.replace(self, stop=tuple(self.stop or ()) + tuple(stops))

    def constrained(self) -> "SamplingParams":
        """Apply `dtype`: it becomes a regex (winning over a user regex) plus extra stops."""
        if self.dtype is None:
            return self
        regex, stops = _DTYPE_CONSTRAINTS[self.dtype]
        if self.regex is not None and self.regex != regex:
            warnings.warn(f"gen(dtype={self.dtype}) overrides regex={self.regex!r}.", stacklevel=2)
        return dataclasses.replace(self, regex=regex).with_extra_stops(stops)

    def to_runtime_dict(self) -> dict:
        """`sampling_params` of a native `/generate` request. Logprob fields travel at top level."""
        out = {}
        for name in _RUNTIME_KEYS:
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, tuple):
                if not value and name in ("stop_regex",):
                    continue  # older/smaller servers may not know the key; empty means nothing anyway
                value = list(value)
            out[name] = value
        return out

    def logprob_fields(self) -> dict:
        """The top-level logprob options of a `/generate` request, only those set."""
        names = ("return_logprob", "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs")
        return {k: getattr(self, k) for k in names if getattr(self, k) is not None}

    def to_openai_kwargs(self) -> dict:
        out = {"max_tokens": self.max_new_tokens, "n": self.n, "stop": list(self.stop) if self.stop else None,
               "temperature": self.temperature, "top_p": self.top_p,
               "frequency_penalty": self.frequency_penalty, "presence_penalty": self.presence_penalty}
        return {k: v for k, v in out.items() if v is not None}


_RUNTIME_KEYS = ("max_new_tokens", "min_new_tokens", "n", "stop", "stop_token_ids", "stop_regex",
                 "temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
                 "ignore_eos", "regex", "json_schema")

DEFAULT_SAMPLING_PARAMS = SamplingParams(
    max_new_tokens=128, min_new_tokens=0, n=1, stop=(), stop_token_ids=(), stop_regex=(),
    temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0, frequency_penalty=0.0, presence_penalty=0.0,
    ignore_eos=False)


# ---------------------------------------------------------------------------------------------
# Expression nodes

_node_ids = itertools.count()


@dataclass(frozen=True, eq=False)
class Expr:
    """Base of every node. Identity equality; `node_id` is unique per process."""

    node_id: int = field(default_factory=lambda: next(_node_ids), init=False, repr=False, compare=False)

    def __add__(self, other):
        return ExprList.concat(self, other)

    def __radd__(self, other):
        return ExprList.concat(other, self)

    def named_outputs(self):
        """Names of the variables this node defines (gen/select/var scope), in order."""
        return ()


def as_expr(value) -> Expr:
    if isinstance(value, Expr):
        return value
    if isinstance(value, str):
        return ConstantText(value)
    if isinstance(value, Argument):
        return ArgumentRef(value.name)
    raise TypeError(f"Expected a str or an lmprog expression, got {type(value).__name__}: {value!r}.")


@dataclass(frozen=True, eq=False)
class ExprList(Expr):
    exprs: Tuple[Expr, ...] = ()

    @classmethod
    def concat(cls, *parts) -> "ExprList":
        flat = []
        for part in parts:
            flat.extend(part.exprs if isinstance(part, ExprList) else (as_expr(part),))
        return cls(tuple(flat))

    @property
    def expr_list(self):  # SGLang's name
        return list(self.exprs)

    def named_outputs(self):
        return tuple(name for e in self.exprs for name in e.named_outputs())

    def __repr__(self):
        return f"ExprList({list(self.exprs)})"


@dataclass(frozen=True, eq=False)
class ConstantText(Expr):
    value: str = ""

    def __repr__(self):
        return f"Constant({self.value!r})"


@dataclass(frozen=True, eq=False)
class Gen(Expr):
    name: Optional[str] = None
    sampling_params: SamplingParams = SamplingParams()

    def named_outputs(self):
        return (self.name,)

    def __repr__(self):
        return f"Gen({self.name!r})"


@dataclass(frozen=True, eq=False)
class Select(Expr):
    name: Optional[str] = None
    choices: Tuple[str, ...] = ()
    temperature: float = 0.0
    choices_method: Any = None

    def named_outputs(self):
        return (self.name,)

    def __repr__(self):
        return f"Select({self.name}, choices={list(self.choices)}, choices_method={self.choices_method})"


@dataclass(frozen=True, eq=False)
class RoleBegin(Expr):
    role: str = "user"


@dataclass(frozen=True, eq=False)
class RoleEnd(Expr):
    role: str = "user"


@dataclass(frozen=True, eq=False)
class Image(Expr):
    path: Any = None


@dataclass(frozen=True, eq=False)
class Video(Expr):
    path: Any = None
    num_frames: int = 0


@dataclass(frozen=True, eq=False)
class Variable(Expr):
    """The value of variable `name` of another state (`source`), appended as text."""

    name: str = ""
    source: Any = None

    def __repr__(self):
        return f"Variable({self.name!r})"


@dataclass(frozen=True, eq=False)
class VarScopeBegin(Expr):
    name: str = ""

    def named_outputs(self):
        return (self.name,)


@dataclass(frozen=True, eq=False)
class VarScopeEnd(Expr):
    name: str = ""


@dataclass(frozen=True, eq=False)
class CommitLazy(Expr):
    """Send the state's text to the backend as a zero-token request (a prefix-cache hint)."""


@dataclass(frozen=True, eq=False)
class ConcatAndAppend(Expr):
    states: Tuple[Any, ...] = ()


@dataclass(frozen=True, eq=False)
class SeparateReasoning(Expr):
    model_type: Optional[str] = None
    expr: Optional[Expr] = None
    name: str = ""

    def named_outputs(self):
        return (self.name,)

    def __repr__(self):
        return f"SeparateReasoning(model_type={self.model_type}, name={self.name})"


@dataclass(frozen=True, eq=False)
class Fork(Expr):
    """Traced only: the point where a program forks `number` branches."""

    number: int = 1


@dataclass(frozen=True, eq=False)
class GetForkItem(Expr):
    """Traced only: branch `index` of the preceding `Fork`."""

    index: int = 0


class StopTracing(Exception):
    """Raised while tracing when the program reads a value only a real run can know."""


class Argument:
    """A tracing placeholder for a program argument whose value is unknown.

    It can be appended to a state (`s += arg`, `"Q: " + arg`) but not inspected:
    formatting it into an f-string raises `TypeError`; asking its truth, length or
    items stops tracing.
    """

    def __init__(self, name: str, value=None):
        self.name, self.value = name, value

    def __format__(self, spec):
        raise TypeError("Cannot put argument inside a f-string. This is not compatible with the tracer; "
                        f"concatenate instead (`'...' + {self.name}`).")

    def __add__(self, other):
        return _argument_concat(self, other)

    def __radd__(self, other):
        return _argument_concat(other, self)

    def _stop(self, *args):
        raise StopTracing(f"argument {self.name!r} is inspected")

    __bool__ = __len__ = __getitem__ = __int__ = __iter__ = _stop

    def __repr__(self):
        return f"Argument(name={self.name}, value={self.value!r})"


@dataclass(frozen=True, eq=False)
class ArgumentRef(Expr):
    """An unknown argument inside a traced graph."""

    name: str = ""

    def __repr__(self):
        return f"Argument({self.name})"


def _argument_concat(left, right) -> ExprList:
    parts = [ArgumentRef(p.name) if isinstance(p, Argument) else p for p in (left, right)]
    return ExprList.concat(*parts)


# SGLang's class names, for code that imports them.
SglExpr, SglExprList, SglConstantText, SglGen, SglSelect = Expr, ExprList, ConstantText, Gen, Select
SglRoleBegin, SglRoleEnd, SglImage, SglVideo, SglVariable = RoleBegin, RoleEnd, Image, Video, Variable
SglVarScopeBegin, SglVarScopeEnd, SglCommitLazy = VarScopeBegin, VarScopeEnd, CommitLazy
SglConcateAndAppend, SglSeparateReasoning, SglArgument, SglSamplingParams = (
    ConcatAndAppend, SeparateReasoning, Argument, SamplingParams)
