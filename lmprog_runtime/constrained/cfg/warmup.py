"""Masks paid at compile time: a new grammar's first masks are its slowest (every state and
transition is new to its table: docs/constrained.md, "Where the time went next"), and a mask
is on the critical path of a decode step, while compiling runs on the grammar queue's thread
before the request is admitted. So a compiled grammar computes its root mask and, for a JSON
Schema, walks five small instances of the schema (`sample`: compact, its alternative branches
with a key of each pattern property and undeclared keys where the object allows them,
pretty-printed with numbers below zero, required properties only, the first with its keys
in reverse order: `_turned`; for a schema without `type`, a value of each kind; then where
any value may stand or a type list allows several, a value of each kind there in turn:
`sample(pick=k)`), token by token, as a request would:
the structural rows every output needs (the object's keys and their closes, `:` `,` `}`, each
property's value starts and string bodies) are derived then, and the masks of those states
are in the grammar's cache when the first request asks. References are followed as the
compiler resolves them (refs.RefIndex: relative URIs against the `$id`s around them, remote
documents of the local registry; a `$dynamicRef` to its static target; its siblings hold
too), and a sampled anyOf / oneOf branch keeps the properties written beside the choice (an
`if` is met, with its `then`, in the first samples, its `else` taken in the alternative one,
and every dependentSchemas branch joined). A string with a `pattern` gets one
of the pattern's shortest matches (or its schema's own example), so that the walk passes it
and goes on to the properties after it, and the pattern's states along it are walked.

Only speed depends on this: masks come from the same engine either way, and a sample the
grammar refuses (a pattern or a bound it does not meet, a check) stops the walk at its first
refused token, keeping what was walked; a compact sample refused inside an object member is
walked again without that member (at most PRUNES times), so the members after it are walked
too, and a property no value satisfies (`false`, `{"not": {}}`) is left out of the samples.
Bounded by WARMUP_S of wall time (garbage collections aside) and MAX_TOKENS tokens.
"""

from __future__ import annotations

import functools
import gc
import json
import threading
import time
from typing import Any, List, Optional

import numpy as np

from lmprog_runtime.constrained.base import GrammarError
from lmprog_runtime.constrained.json_schema import _json_type
from lmprog_runtime.constrained.cfg.canonical import number_top
from lmprog_runtime.constrained.cfg.machine import _NUM
from lmprog_runtime.constrained.cfg.regex import MAX_CP, RegexError, RegexPool
from lmprog_runtime.constrained.cfg.refs import RefIndex
from lmprog_runtime.constrained.cfg.regex_parse import compile_pattern
from lmprog_runtime.constrained.regex_fragments import UnsupportedSchemaError

WARMUP_S = 0.05      # wall time a compile may spend walking its sample
SAMPLE_S = 0.02      # ... and making one sample's pattern texts (then patterns get "abc")
MAX_TOKENS = 256     # tokens of the sample walked at most
MAX_DEPTH = 6        # nesting of the sample (a recursive schema stops here)
MAX_PROPERTIES = 24  # properties of one object in the sample
MAX_VALUES = 400     # values in one sample (nested objects multiply)
ALT_PATTERN_CHARS = 12  # the alternative sample's pattern texts are this long at least, where one is found
ENUM_ITEMS = 8       # an array of enum members: the alternative sample's items are its first members, this many
PRUNES = 2           # a compact sample refused inside a member is walked again without it, this many times at most
NUMBER_NODES = 16    # number rules whose number parts are made (`_number_parts`), at most
NUMBER_FRAMES = 24   # ... and number frames of each (their canonical forms), at most
NUMBER_PARTS = 96    # ... and of them all (the engine keeps MEMO_UNIONS of them)
# a number's bytes in the order its texts are explored: the digits and marks numbers most
# often begin with first (0, 1, a fraction's point, a sign, an exponent), then the others
_NUMBER_ORDER = tuple(b"01.-e23456789E+")
_EXPONENT_ORDER = tuple(b"1+-")  # (an exponent's: its texts are kept, each digit a state)
_FORMATS = {"date": "2020-01-31", "date-time": "2020-01-31T12:00:00Z", "time": "12:00:00Z",
            "email": "ab@example.com", "uri": "https://example.com/a", "uuid": "123e4567-e89b-12d3-a456-426614174000",
            "ipv4": "10.0.0.1", "ipv6": "::1", "hostname": "example.com"}
# dates and times of the other samples (alt 1, negative): other first digits of the month,
# day and hour, and a month of each length (31 days, February of a leap year, 30 days), each
# a state of the format's pattern of its own
_TIMES = {"2020-01-31": ("2020-01-31", "2024-02-15", "2021-11-05"),
          "2020-01-31T12:00:00Z": ("2020-01-31T12:00:00Z", "2024-02-15T09:30:45+01:00", "2021-11-05T23:59:59.5Z"),
          "12:00:00Z": ("12:00:00Z", "09:30:45+01:00", "23:59:59.5Z")}
_NONE = object()  # no sample value
# the kind samples' values where any value may stand (`sample(pick=k)`: the k-th), one
# sample per kind: outputs write any kind there, and each starts states of its own
_ANY_KINDS = (12, "abc", [1, 2], True, None, {"a": 1}, -1.5)
KINDS = len(_ANY_KINDS)  # kind samples walked after the five (each where it differs from those before)
# values of every kind, walked (as far as the grammar takes each) for a schema without `type`
# (numbers: a fraction and one below zero, so the states of a point and a sign are walked too;
# an array whose first item is a token of its own: `[` alone, not `["`, is the state after it)
_OTHER_KINDS = ("abc", 12.5, -1.5, {"a": "abc", "b": 1}, [1, "abc"], True, None)  # (`":` then a number: tokens of their own)
# the kind of value a schema without `type` most likely describes, by its keywords
_KIND_WORDS = (
    ("object", frozenset(("properties", "required", "patternProperties", "additionalProperties", "propertyNames",
                          "minProperties", "maxProperties", "dependentRequired", "dependentSchemas",
                          "dependencies", "unevaluatedProperties"))),
    ("array", frozenset(("items", "prefixItems", "additionalItems", "minItems", "maxItems", "uniqueItems",
                         "contains", "minContains", "maxContains", "unevaluatedItems"))),
    ("string", frozenset(("minLength", "maxLength", "pattern", "format"))),
    ("number", frozenset(("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"))))
# keywords that constrain a value (a schema with none of them, annotations and unknown
# keywords aside, takes any value)
_ASSERTIONS = frozenset((
    "type", "enum", "const", "properties", "patternProperties", "additionalProperties", "items", "prefixItems",
    "additionalItems", "contains", "minItems", "maxItems", "uniqueItems", "minContains", "maxContains", "required",
    "dependentRequired", "dependentSchemas", "dependencies", "propertyNames", "minProperties", "maxProperties",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "minLength", "maxLength", "pattern",
    "format", "allOf", "anyOf", "oneOf", "not", "if", "then", "else", "$ref", "$dynamicRef", "$recursiveRef",
    "unevaluatedProperties", "unevaluatedItems"))


def sample(schema: Any, root: Any = None, depth: int = 0, alt: int = 0, budget: Optional[list] = None,
           required: bool = False, negative: bool = False, pick: int = 0) -> Any:
    """A small JSON value the schema likely accepts (every declared property and required
    key, every allOf branch together, the first branch of a choice, a scalar's own
    `examples` / `default`, a pattern's shortest match, bounds' lower ends, a value of any
    kind an object or an array of other kinds, an enum's first member (the second where
    `negative`, the middle one where `required`); `alt` 1:
    the last branch and enum member, two array items (an enum's: its first members), longer
    strings, a fraction, a number between its bounds or past a minimum alone; `required`:
    of an object that lists required properties, only those; `negative`: numbers below zero
    where no minimum forbids it; `pick` k > 0: where any value may stand, _ANY_KINDS' k-th,
    a type list's k-th type (cyclically), two array items, and in an open object with no
    property declared one undeclared key), or `_NONE`. Best effort: the walk checks it.
    At most MAX_VALUES values (`budget`: the count left, shared by the recursion, and the
    time.monotonic() past which patterns get no sample)."""
    root = schema if root is None else root
    budget = [MAX_VALUES, time.monotonic() + SAMPLE_S] if budget is None else budget
    budget[0] -= 1
    if budget[0] < 0:
        return _NONE
    if schema is True and depth <= MAX_DEPTH:
        schema = {}  # (any value)
    if not isinstance(schema, dict) or depth > MAX_DEPTH:
        return _NONE if schema is False else None
    if schema.get("not") is True or schema.get("not") == {}:
        return _NONE  # (no value: a property of it is left out, so the walk goes on past it)
    if "const" in schema:
        return schema["const"]
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        members = [v for v in schema["enum"] if _has_type(v, schema.get("type"))]
        if not members:
            return _NONE
        # (the first member, the last (alt), the second (negative), the middle one (required):
        # each member's text is states of its own)
        if negative or required:
            return members[1 % len(members)] if negative else members[len(members) // 2]
        return members[-alt]
    for key in ("$ref", "$dynamicRef"):  # (a dynamic one: its static target, a sample the walk checks)
        target = _target(schema, key, root)
        if target is not None:
            rest = {k: v for k, v in schema.items() if k != key}
            if isinstance(target, dict) and rest:  # (its siblings apply too: as an allOf's branches)
                _merge(rest, target)
                target = rest
            return sample(target, root, depth + 1, alt, budget, required, negative, pick)
    branches = schema.get("allOf")
    if isinstance(branches, list) and branches and all(isinstance(b, dict) for b in branches):
        merged = {k: v for k, v in schema.items() if k != "allOf"}
        for branch in branches:  # (every branch holds: their properties and required keys together)
            _merge(merged, _resolved(branch, root))
        return sample(merged, root, depth + 1, alt, budget, required, negative, pick)
    if isinstance(schema.get("if"), dict) or isinstance(schema.get("dependentSchemas"), dict):
        # (the `if` met and its `then` in the first samples, its `else` in the alternative
        # one; every dependentSchemas branch, its key likely written: their properties too)
        merged = {k: v for k, v in schema.items() if k not in ("if", "then", "else", "dependentSchemas")}
        branches = [schema.get("else")] if alt else [schema.get("if"), schema.get("then")]
        branches += list(schema["dependentSchemas"].values()) if isinstance(schema.get("dependentSchemas"), dict) else []
        for branch in branches:
            if isinstance(branch, dict):
                _merge(merged, _resolved(branch, root))
        return sample(merged, root, depth + 1, alt, budget, required, negative, pick)
    for key in ("anyOf", "oneOf"):
        branches = schema.get(key)
        if isinstance(branches, list) and branches and isinstance(branches[-alt], dict):
            merged = {k: v for k, v in schema.items() if k != key}
            _merge(merged, _resolved(branches[-alt], root), over=True)
            return sample(merged, root, depth + 1, alt, budget, required, negative, pick)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = (kind[pick % len(kind)] if pick and kind else
                next((k for k in kind if k != "null"), kind[0] if kind else None))
    if kind is None:  # (the kind the schema's keywords apply to: e.g. a number under `minimum`)
        kind = next((k for k, words in _KIND_WORDS if not words.isdisjoint(schema)), None)
    if kind == "object":
        out = {}
        props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        needed = schema.get("required")
        if required and isinstance(needed, list) and needed:
            props = {k: v for k, v in props.items() if k in needed}
        for name, sub in list(props.items())[:MAX_PROPERTIES]:
            value = sample(sub, root, depth + 1, alt, budget, required, negative, pick)
            if value is not _NONE:
                out[name] = value
        more = schema.get("additionalProperties", True)
        for name in (needed if isinstance(needed, list) else [])[:MAX_PROPERTIES]:
            if isinstance(name, str) and name not in out and name not in props and more is not False:
                # (a required key no `properties` declares: a value of additionalProperties' schema)
                value = sample(more if isinstance(more, dict) else {}, root, depth + 1, alt, budget,
                               negative=negative, pick=pick)
                if value is not _NONE:
                    out[name] = value
        if (alt or (pick and not out)) and not required:
            out.update(_extra_members(schema, root, depth, alt, budget, out, negative, pick))
        return out
    if kind == "array":
        items = schema.get("prefixItems") if isinstance(schema.get("prefixItems"), list) else None
        if items:
            vals = [sample(s, root, depth + 1, alt, budget, required, negative, pick) for s in items]
            most, rest = schema.get("maxItems"), schema.get("items", {})
            if (alt or pick) and rest is not False and not (_is_count(most) and most <= len(items)):
                # (alt: an item past the prefix, where `items` and maxItems allow one: a state of its own)
                vals.append(sample(rest, root, depth + 1, alt, budget, required, negative, pick))
        else:
            # (alt: two items at least, where maxItems allows: the array's count past its
            # checks is one state, that of every item after the first)
            least, most = schema.get("minItems", 1), schema.get("maxItems")
            n = least if _is_count(least) else 1
            if (alt or pick) and not (_is_count(most) and most < 2):
                n = max(n, 2)
            item = schema.get("items", {})
            members = item.get("enum") if isinstance(item, dict) else None
            if alt and isinstance(members, list) and len(members) > 1 and not (_is_count(most) and most < 2):
                # (an enum's items: its members one after another, each prefix a state of its own)
                vals = [v for v in members if _has_type(v, item.get("type"))][:min(most, ENUM_ITEMS)
                                                                             if _is_count(most) else ENUM_ITEMS]
            else:
                one = sample(item, root, depth + 1, alt, budget, required, negative, pick)
                vals = [one] * (n if n <= 4 else 1)
        return [v for v in vals if v is not _NONE]
    if kind is None and _ASSERTIONS.isdisjoint(schema) and not required:
        # any value (`{}`): as outputs write one, an object of a string and a number, an
        # array of a string, a fraction and an object, numbers below zero in the pretty one
        if pick:
            return _ANY_KINDS[(pick - 1) % len(_ANY_KINDS)]
        if negative:
            return {"a": -1, "b": [1, "x"]}
        return ["abc", 0.5, {"c": "abc", "d": True}] if alt else {"a": "abc", "b": 1}
    given = _given(schema, kind)
    if given is not _NONE and not alt:
        return given
    if kind == "string":
        lo, hi = schema.get("minLength"), schema.get("maxLength")
        pattern = schema.get("pattern")
        least = lo if isinstance(lo, int) and not isinstance(lo, bool) else None
        text = None
        if isinstance(pattern, str) and time.monotonic() < budget[1]:
            if alt:  # (a longer match: the states of a counted repetition along it)
                text = _pattern_text(pattern, max(least or 0, ALT_PATTERN_CHARS))
            if text is None:
                text = _pattern_text(pattern, least)
        if text is not None:
            return text
        text = _FORMATS.get(schema.get("format"), "Abc de-f 12" if alt else "abc")
        text = _TIMES.get(text, (text,) * 3)[2 if negative else alt]
        if isinstance(lo, int) and len(text) < lo:
            text = text + "a" * min(lo - len(text), 64)
        if isinstance(hi, int) and len(text) > hi >= 0:
            text = text[:hi]
        return text
    if kind in ("integer", "number"):
        lo = schema.get("minimum", schema.get("exclusiveMinimum"))
        hi = schema.get("maximum", schema.get("exclusiveMaximum"))
        # (alt: 0, which is a number state of its own, and one outputs often write; 1 where
        # the schema's own value, which the first sample takes, is 0)
        value = lo if _is_number(lo) else (0 if alt and given != 0 else 1)
        if alt and _is_number(lo) and _is_number(hi) and hi - lo >= 2:
            # (between the bounds, more digits than the minimum: digits' states that most
            # texts within the bounds share, canonical._number_class)
            value = int(lo + (hi - lo) * 0.6)
        elif alt and _is_number(lo) and not _is_number(hi) and lo >= 0:
            value = int(lo) + 1  # (past the minimum: one free digit's state, canonical._met_minimum)
        if negative and not _is_number(lo):  # (a sign: its own state, outputs often write one)
            value = -1
        elif negative and lo >= 0:
            # (no sign allowed: a 1 and more digits than the minimum has, a class of texts of
            # its own under a minimum alone: canonical._number_class)
            wide = int("1" + "2" * len(str(int(lo))))
            if not _is_number(hi) or wide <= hi:
                value = wide
        if "exclusiveMinimum" in schema and value == schema["exclusiveMinimum"]:
            value = value + 1
        if alt and kind == "number" and float(value).is_integer():
            value = value + 0.5
        return int(value) if kind == "integer" and float(value).is_integer() else value
    if kind == "boolean":
        return True
    return None


def _resolved(schema: dict, root: Any) -> dict:
    """A `$ref` schema's target (one hop), else the schema."""
    target = _target(schema, "$ref", root)
    return target if isinstance(target, dict) else schema


def _target(schema: dict, key: str, root: Any) -> Optional[Any]:
    """The schema reference `schema[key]` names, or None: through the compiler's RefIndex
    where the warm-up has one (any URI, against the `$id`s around it, remote documents from
    the local registry), else a pointer into the root document."""
    ref = schema.get(key)
    if not isinstance(ref, str):
        return None
    if isinstance(root, RefIndex):
        try:
            return root.resolve(ref, schema)
        except (UnsupportedSchemaError, ValueError, KeyError, TypeError):
            return None
    return _pointer(root, ref[1:]) if ref.startswith("#") else None


def _merge(into: dict, branch: dict, over: bool = False) -> None:
    """Branch `branch` merged into the schema `into`: properties and required keys joined,
    other keywords kept where `into` has none (an allOf's), or the branch's (`over`: the
    anyOf / oneOf branch sampled)."""
    for k, v in branch.items():
        if k == "properties" and isinstance(v, dict) and isinstance(into.get(k), dict):
            into[k] = {**into[k], **v}
        elif k == "required" and isinstance(v, list) and isinstance(into.get(k), list):
            into[k] = into[k] + [n for n in v if n not in into[k]]
        elif over:
            into[k] = v
        else:
            into.setdefault(k, v)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _has_type(value: Any, kind: Any) -> bool:
    """`value` is of JSON Schema type `kind` (a name or a list of names; anything else: any
    type), so that a sample does not take an enum member its type refuses."""
    kinds = kind if isinstance(kind, list) else [kind] if isinstance(kind, str) else None
    return kinds is None or bool(_json_type(value) & set(kinds))


def _extra_members(schema: dict, root: Any, depth: int, alt: int, budget: list, out: dict,
                   negative: bool = False, pick: int = 0) -> dict:
    """Members past the declared properties, as outputs write them: one key of each pattern
    property (a shortest match of its pattern) and, where undeclared keys are allowed (a
    missing additionalProperties allows any), one such key with a sample of its schema (any
    value: a string; under a propertyNames enum, one of its members, under its pattern, one
    of the pattern's matches). The walk then passes
    through an undeclared key's text and its value's start, whose masks are shared by every
    such key (MaskEngine._key_near)."""
    extra = {}
    patterns = schema.get("patternProperties")
    if isinstance(patterns, dict):
        for pattern, sub in list(patterns.items())[:4]:
            key = None
            if isinstance(pattern, str) and time.monotonic() < budget[1]:
                # (alt: a longer key, where one matches: a counted repetition's states along it)
                for least in ((ALT_PATTERN_CHARS, ALT_PATTERN_CHARS // 2) if alt else ()) + (1,):
                    key = _pattern_text(pattern, least)
                    if key is not None:
                        break
            if key is not None and key not in out:
                value = sample(sub, root, depth + 1, alt, budget, negative=negative, pick=pick)
                if value is not _NONE:
                    extra[key] = value
    # (beside no additionalProperties, unevaluatedProperties' schema: that of the keys no
    # other part declares, as an undeclared key likely is)
    more = schema.get("additionalProperties", schema.get("unevaluatedProperties", True))
    names = schema.get("propertyNames")
    if more is not False and not extra:
        key = "extra_key"
        if isinstance(names, dict):  # (the keys its propertyNames allow: a member of its enum, a match of its pattern)
            members = [names["const"]] if "const" in names else names.get("enum")
            if not isinstance(members, list) and isinstance(names.get("pattern"), str) \
                    and time.monotonic() < budget[1]:
                members = [_pattern_text(names["pattern"], names.get("minLength"))]
            props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
            key = next((k for k in members if isinstance(k, str) and k not in out and k not in props), None) \
                if isinstance(members, list) else None
        if key is not None and key not in out:
            free = not (isinstance(more, dict) and more)
            if pick:
                value = sample(more if isinstance(more, dict) else {}, root, depth + 1, 0, budget, pick=pick)
            else:
                value = "abc" if free else sample(more, root, depth + 1, alt, budget, negative=negative)
            if value is not _NONE:
                extra[key] = value
            if pick or isinstance(names, dict):  # (other names: refused by propertyNames, likely)
                return extra
            if free and "extra_num" not in out:
                extra["extra_num"] = 1  # (any value: one whose start is a token of its own, after `":`)
            if free and "extra_obj" not in out and depth < MAX_DEPTH:
                extra["extra_obj"] = {"a": "abc", "b": True}  # (... and an object, its values any)
    return extra


def _given(schema: dict, kind: Any) -> Any:
    """The schema's own example of a scalar value (its first `examples` member, else its
    `default`) when it has the schema's type, else `_NONE`: the value outputs most likely
    hold, and where a pattern or a format constrains a string, one that meets it."""
    examples = schema.get("examples")
    for value in ([examples[0]] if isinstance(examples, list) and examples else []) + [schema.get("default", _NONE)]:
        if kind == "string" and isinstance(value, str) and len(value) <= 256:
            return value
        if kind in ("integer", "number") and isinstance(value, (int, float)) and not isinstance(value, bool):
            return value
    return _NONE


# A pattern's sample: the search gives up after this many steps (a pattern whose shortest
# match is long or whose states branch widely gets no sample: the walk falls back to "abc")
PATTERN_STEPS = 4096
# Preferred characters of a class, best first: digits (each is a token of its own, so the
# walk meets every state of the pattern along its sample), then letters, then the rest
_NICE = [(0x30, 0x39), (0x61, 0x7A), (0x41, 0x5A), (0x2D, 0x2E), (0x5F, 0x5F), (0x20, 0x7E), (0xA0, 0xD7FF)]


@functools.lru_cache(maxsize=256)
def _pattern_text(pattern: str, least: Any) -> Optional[str]:
    """A short text `pattern` (JSON Schema's search semantics) matches, at least `least`
    characters long where that is an int <= 64: breadth first over the pattern's states
    (regex.py's derivatives), stepping one representative character of each class of code
    points the pattern's character sets do not tell apart (a digit, a lower-case letter, ...
    where the class holds one). None when the pattern does not compile or PATTERN_STEPS
    steps find no such text."""
    least = least if isinstance(least, int) and 0 <= least <= 64 else 0
    pool = RegexPool(max_terms=PATTERN_STEPS)
    try:
        start = compile_pattern(pool, pattern)
        bounds = [0] + pool.charset_bounds()
        reps = []
        for lo, hi in zip(bounds, bounds[1:] + [MAX_CP + 1]):
            if lo < hi:  # class [lo, hi): its nicest code point, ranked by _NICE
                rank, cp = next(((k, max(lo, a)) for k, (a, b) in enumerate(_NICE) if max(lo, a) < min(hi, b + 1)),
                                (len(_NICE), lo))
                if not 0xD800 <= cp <= 0xDFFF:  # (a lone surrogate is no text)
                    reps.append((rank, cp))
        reps = [cp for _, cp in sorted(reps)]
        seen = {(start, 0): None}
        queue = [(start, 0)]
        steps = 0
        for node in queue:
            state, n = node
            if n >= least and pool.nullable(state):
                out = []
                while seen[node] is not None:
                    node, ch = seen[node]
                    out.append(ch)
                return "".join(reversed(out))
            for cp in reps:
                steps += 1
                if steps > PATTERN_STEPS:
                    return None
                nxt = (pool.step(state, cp), min(n + 1, least))
                if nxt[0] != pool.NONE and nxt not in seen:
                    seen[nxt] = (node, chr(cp))
                    queue.append(nxt)
    except (RegexError, RecursionError):
        return None
    return None


def _pointer(root: Any, pointer: str) -> Optional[Any]:
    node = root.root if isinstance(root, RefIndex) else root
    for part in filter(None, pointer.split("/")):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


class SampleTokenizer:
    """The samples' tokenizer: a private copy of the model's fast tokenizer's Rust core, made
    on first use and called under a lock. The serving tokenizer is not shared with the
    compile threads (transformers' wrapper may reconfigure its core per call, and a core
    borrowed by two threads at once raises in one of them)."""

    def __init__(self, tokenizer):
        self._source = getattr(tokenizer, "backend_tokenizer", None)
        self._own = None
        self._lock = threading.Lock()

    def encode(self, text: str) -> Optional[List[int]]:
        """Token ids of `text` (no special tokens), or None without a fast tokenizer."""
        if self._source is None:
            return None
        with self._lock:
            if self._own is None:
                from tokenizers import Tokenizer
                self._own = Tokenizer.from_str(self._source.to_str())
            return self._own.encode(text, add_special_tokens=False).ids


def warm(grammar, tokenizer: Optional[SampleTokenizer], schema_text: Optional[str], registry=None) -> None:
    """Compute `grammar`'s root mask and, given its JSON Schema, walk sample instances
    (see the module docstring); the grammar is left where it started. registry: where the
    schema's remote `$ref`s resolve (the compiler's SchemaRegistry), for the samples."""
    row = np.empty(grammar._shared.vocab_size, dtype=np.bool_)
    grammar.write_mask(row)
    if schema_text is None or tokenizer is None:
        return
    try:
        schema = json.loads(schema_text)
        try:  # (references resolved as the compiler does: relative URIs, `$id`s, remote documents)
            root = RefIndex(schema, registry)
        except (UnsupportedSchemaError, ValueError, TypeError):
            root = schema
        texts, samples = [], []  # (the compact samples' values, to prune where refused)
        values = []
        for alt, indent, required in ((0, None, False), (1, None, False), (0, 2, False), (0, None, True)):
            value = sample(schema, root, alt=alt, required=required, negative=indent is not None)
            if value is not _NONE:
                values.append((value, indent))
        if values:
            values.append((_turned(values[0][0]), None))
        if isinstance(schema, dict) and "type" not in schema:  # (its keywords leave other kinds free)
            values.extend((v, None) for v in _OTHER_KINDS)
        for k in range(1, KINDS + 1):
            value = sample(schema, root, pick=k)
            if value is not _NONE:
                values.append((value, None))
        for value, indent in values:
            text = json.dumps(value, indent=indent, separators=(",", ": ") if indent else (",", ":"),
                              ensure_ascii=False)
            if text not in texts:
                texts.append(text)
                samples.append(value if indent is None else None)
    except (ValueError, TypeError, RecursionError):
        return
    encoded = [tokenizer.encode(text) for text in texts]  # (the first call makes the tokenizer)
    deadline = _clock() + WARMUP_S
    table = grammar._shared.table
    for value, tokens in zip(samples, encoded):
        for _ in range(PRUNES + 1):
            if tokens is None:
                break
            done, stop = _walk(grammar, row, tokens, deadline)
            if not done:
                return
            if stop is None or value is None:
                break
            # refused inside a member (a value the schema's checks refuse): the sample without it
            value = _without_member_at(value, sum(len(table[t] or b"") for t in tokens[:stop]))  # (its first byte)
            text = json.dumps(value, separators=(",", ":"), ensure_ascii=False) if value is not None else None
            if text is None or text in texts:
                break
            texts.append(text)
            tokens = tokenizer.encode(text)
    _number_parts(grammar, deadline)


def _number_parts(grammar, deadline: float) -> None:
    """The number parts (MaskEngine._number_part: the tokens that step a number frame alone)
    of canonical number frames of each number rule the grammar reaches, NUMBER_FRAMES per
    rule: those along the texts of its own numbers (`_number_seeds`), then texts explored
    breadth first in _NUMBER_ORDER. A number's text is a state of its own at every token
    (SmolLM2 spells each digit as one), and where a rule keeps its text (an enum or const,
    multipleOf; bounds where no class stands for it: canonical.py) each is a new number
    part: made here, `0.0` under `const: 0` or `300.0` under `maximum: 300` is a memo hit at
    its first request."""
    shared = grammar._shared
    engine, machine = shared.engine, shared.machine
    if not engine._json or not engine.use_c or machine.root is None:
        return
    subtrees, free = engine.vocab.number_subtrees, engine.vocab.exponent_free
    made = [0]

    def part(frame, seen: set) -> Optional[bool]:
        """frame's number part made (its canonical form's): True where that form is new,
        False where it was met, None once out of time or budget."""
        if _clock() > deadline or made[0] >= NUMBER_PARTS or len(seen) >= NUMBER_FRAMES:
            return None
        top = number_top(frame, free)
        if top in seen:
            return False
        seen.add(top)
        engine._number_part(top, subtrees)
        made[0] += 1
        return True

    def step(node, frame, b: int):
        """The number frame after byte b (rule `node`'s value begun with it where `frame` is
        None: its check's frame, if any, is below the top), or None."""
        if frame is None:
            got = machine.start_value(None, node, b, 0, None)
        elif b in _NUM[frame[3]]:
            got = machine.step((frame, None), b, 0, None)
        else:
            return None
        return got[0][0] if got and got[0][0][0] == "N" else None

    for node in _number_nodes(machine.root):
        seen: set = set()
        for text in _number_seeds(node):
            frame = None
            for b in text.encode():
                frame = step(node, frame, b)
                if frame is None:
                    break
                if part(frame, seen) is None:
                    break
        # (breadth first from the forms not met yet: a free number's texts are all "0")
        level, met = [f for f in (step(node, None, b) for b in _NUMBER_ORDER) if f is not None], set()
        while level:
            nxt = []
            for frame in level:
                new = part(frame, met)
                if new is None:
                    break
                if new:  # (an exponent keeps its text: one digit of it, not each)
                    order = _NUMBER_ORDER if frame[3] < 6 else _EXPONENT_ORDER
                    nxt.extend(f for f in (step(node, frame, b) for b in order) if f is not None)
            else:
                level = nxt
                continue
            break
        if made[0] >= NUMBER_PARTS or _clock() > deadline:
            return


def _number_seeds(node) -> list:
    """Texts of the numbers a rule names (its bounds, multipleOf, enum members: the first
    ENUM_ITEMS), in plain notation, each integer also with a `.0` (a number equal to an
    integer, as outputs often write it); none past 24 characters."""
    values = [node.lo, node.hi, node.multiple_of] + list(node.num_enum or ())[:ENUM_ITEMS]
    out: list = []
    for v in values:
        if v is None or not v.is_finite():
            continue
        text = format(v.normalize(), "f") if v else "0"
        for t in (text, text + ".0") if "." not in text else (text,):
            if len(t) <= 24 and t not in out:
                out.append(t)
    return out


def _number_nodes(root) -> list:
    """The rules reachable from `root` whose values may be numbers (NUMBER_NODES at most), in
    breadth-first order: each alternative's, and of an object or array rule each property's,
    pattern property's, undeclared property's and item's rule."""
    out, seen, queue = [], {id(root)}, [root]
    for node in queue:
        if len(out) >= NUMBER_NODES:
            break
        if node.never:
            continue
        if node.alts is None and node.allows_number():
            out.append(node)
        kids = list(node.alts or ())
        if node.alts is None and "object" in node.types:
            kids += list(node.props.values()) + [n for _, n in node.pattern_props] + [node.additional]
        if node.alts is None and "array" in node.types:
            kids += [node.items, *node.prefix]
        for kid in kids:
            if kid is not None and id(kid) not in seen:
                seen.add(id(kid))
                queue.append(kid)
    return out


def _turned(value: Any) -> Any:
    """The sample with each object's members in reverse order and each one-item array's
    item twice: outputs often write keys in another order than the schema's, and an
    object met after other keys (or a later item) is in states of its own (an enclosing
    object's required keys already seen, the array's later items' count)."""
    if isinstance(value, dict):
        return {k: _turned(v) for k, v in reversed(list(value.items()))}
    if isinstance(value, list):
        items = [_turned(v) for v in value]
        return items * 2 if len(items) == 1 else items
    return value


def _clock() -> float:
    """time.monotonic() less the seconds garbage collections took so far: a full collection
    (a fifth of a second in a process holding many grammars) pauses the walk, whichever
    thread ran it, and would otherwise end it, leaving the grammar's first masks to its
    first request."""
    return time.monotonic() - _GC[0]


def _gc_time(phase: str, info: dict) -> None:
    if phase == "start":
        _GC[1] = time.monotonic()
    elif _GC[1]:
        _GC[0] += time.monotonic() - _GC[1]
        _GC[1] = 0.0


_GC = [0.0, 0.0]  # seconds in collections so far, the running one's start (collections hold the GIL)
gc.callbacks.append(_gc_time)


def _walk(grammar, row: np.ndarray, tokens, deadline: float) -> tuple:
    """Walk `tokens` (row: the mask at the grammar's state), computing each state's mask,
    then roll back; (False, None) once past the deadline, else (True, the index of the
    token the grammar refused, or None)."""
    walked = 0
    try:
        for t in tokens[:MAX_TOKENS]:
            if _clock() > deadline:
                return False, None
            if not row[t]:
                return True, walked
            try:
                grammar.accept_token(t)
            except GrammarError:  # the mask looks a byte ahead; the matcher decides
                return True, walked
            walked += 1
            grammar.write_mask(row)
    finally:
        if walked:
            grammar.rollback(walked)
            grammar.write_mask(row)  # the root's again: a memo hit
    return True, None


def _without_member_at(value: Any, offset: int) -> Optional[Any]:
    """`value` without the innermost object member whose compact JSON text holds byte
    `offset` of the value's (its key or a scalar value there), or None where no member does."""
    def size(v) -> int:
        return len(json.dumps(v, separators=(",", ":"), ensure_ascii=False).encode("utf-8"))

    def cut(v, pos: int):
        if not isinstance(v, (dict, list)):
            return None
        p = pos + 1
        for i, (k, x) in enumerate(v.items() if isinstance(v, dict) else enumerate(v)):
            p += 1 if i else 0  # (the comma)
            head = size(k) + 1 if isinstance(v, dict) else 0  # (a key and its colon)
            n = head + size(x)
            if p <= offset < p + n:
                inner = cut(x, p + head) if offset >= p + head else None
                if inner is None and not isinstance(v, dict):
                    return None
                out = dict(v) if isinstance(v, dict) else list(v)
                if inner is None:
                    del out[k]
                else:
                    out[k] = inner
                return out
            p += n
        return None
    return cut(value, 0)
