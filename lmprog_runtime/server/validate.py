"""The request boundary: reading a body into JSON, and checking it against a schema.

Schemas are plain JSON Schema dicts (the subset below), so the same tables that check a
request are published in `/openapi.json`. Supported keywords: type (one name or a list),
enum, minimum, maximum, exclusiveMinimum, minLength, maxLength, pattern, minItems,
maxItems, items, properties, required, additionalProperties (bool or schema),
propertyNames, maxProperties, anyOf, format: regex (Python `re` syntax), and `x-unsupported`
(a message: any value but null is refused with it). A property whose value is JSON null counts as unset.

Every violation raises `SchemaError` (a 400 RequestError) whose message names the field
(a JSON path such as `sampling_params.logit_bias["5"]`), what was expected and what came.
"""

from __future__ import annotations

import json
import math
import re
import zlib
from typing import Any

from lmprog_runtime.generate_request import RequestError

_SURROGATE = re.compile("[\ud800-\udfff]")
_TYPE_CHECKS = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
    "null": lambda v: v is None,
}
_TYPE_WORDS = {"string": "a string", "integer": "an integer", "number": "a number", "boolean": "a boolean",
               "array": "a list", "object": "an object", "null": "null"}


class SchemaError(RequestError):
    """A request field that does not match its schema (HTTP 400)."""

    def __init__(self, path: str, expected: str, actual: Any, detail: str = ""):
        self.path, self.expected = path or "body", expected
        got = detail or show(actual)
        super().__init__(f"{self.path}: expected {expected}, got {got}.")


def show(value: Any, limit: int = 80) -> str:
    """A short, ASCII-safe rendering of a client value (lone surrogates included)."""
    try:
        text = json.dumps(value, ensure_ascii=True)
    except (TypeError, ValueError, RecursionError):
        text = type(value).__name__
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


# -- reading the body ---------------------------------------------------------------------
def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON (numbers must be finite)")


def parse_body(raw: bytes, max_depth: int) -> Any:
    """`raw` as JSON: UTF-8, finite numbers only, nesting at most `max_depth`, no lone
    surrogates anywhere; RequestError(400) naming the problem otherwise."""
    if not raw.strip():
        raise RequestError("The request body is empty; expected a JSON object.")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestError(f"The request body is not valid UTF-8: {e}") from None
    try:
        obj = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise RequestError(f"The request body nests deeper than {max_depth} levels.") from None
    except ValueError as e:  # JSONDecodeError and the constants above
        raise RequestError(f"Malformed JSON in the request body: {e}") from None
    check_tree(obj, max_depth)
    return obj


def check_tree(obj: Any, max_depth: int) -> None:
    """Depth and lone-surrogate check over the whole value, iteratively."""
    stack = [(obj, "", 1)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            if not value.isascii() and _SURROGATE.search(value):
                raise SchemaError(path, "text without lone UTF-16 surrogates", value)
            continue
        if not isinstance(value, (dict, list)):
            continue
        if depth > max_depth:
            raise RequestError(f"The request body nests deeper than {max_depth} levels (at {path or 'body'}).")
        if isinstance(value, dict):
            for k, v in value.items():
                if not k.isascii() and _SURROGATE.search(k):
                    raise SchemaError(path, "keys without lone UTF-16 surrogates", k)
                stack.append((v, _join(path, k), depth + 1))
        elif not all(type(x) is int for x in value):  # token-id lists: nothing to descend into
            stack.extend((v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value))


def decompress(raw: bytes, encoding: str, max_size: int) -> bytes:
    """Decode a `Content-Encoding` (gzip / deflate / identity) with a size bound."""
    encoding = encoding.strip().lower()
    if encoding in ("", "identity"):
        return raw
    wbits = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}.get(encoding)
    if wbits is None:
        raise RequestError(f"Unsupported Content-Encoding {encoding!r}; expected gzip, deflate or identity.", 415)
    d = zlib.decompressobj(wbits)
    try:
        out = d.decompress(raw, max_size + 1)
    except zlib.error as e:
        raise RequestError(f"The request body is not valid {encoding} data: {e}") from None
    if len(out) > max_size:
        raise RequestError(f"The decompressed request body exceeds {max_size} bytes (--max-request-bytes).", 413)
    if not d.eof:
        raise RequestError(f"The request body is truncated {encoding} data.")
    return out


# -- checking against a schema --------------------------------------------------------------
def validate(value: Any, schema: dict, path: str = "") -> None:
    """Raise SchemaError at the first place `value` breaks `schema`."""
    if "x-unsupported" in schema:  # a known field this server cannot honour yet (never ignored)
        raise SchemaError(path, f"unset: {schema['x-unsupported']}", value)
    if "anyOf" in schema:
        return _any_of(value, schema, path)
    types = schema.get("type")
    if types is not None:
        names = types if isinstance(types, list) else [types]
        if not any(_TYPE_CHECKS[t](value) for t in names):
            raise SchemaError(path, describe(schema), value)
    if "enum" in schema and value not in schema["enum"]:
        raise SchemaError(path, "one of " + ", ".join(json.dumps(e) for e in schema["enum"]), value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        _number(value, schema, path)
    elif isinstance(value, str):
        _string(value, schema, path)
    elif isinstance(value, list):
        _array(value, schema, path)
    elif isinstance(value, dict):
        _object(value, schema, path)


def _any_of(value, schema: dict, path: str) -> None:
    branches = schema["anyOf"]
    typed = [b for b in branches if "type" not in b or _type_ok(value, b)]
    if len(typed) > 1 and isinstance(value, list):  # lists: the first item picks (an empty one: the first)
        by_item = [b for b in typed if value and ("type" not in b.get("items", {}) or _type_ok(value[0], b["items"]))]
        if value and not by_item:
            raise SchemaError(f"{path}[0]", " or ".join(describe(b.get("items", {})) for b in typed), value[0])
        typed = by_item or typed[:1]
    if len(typed) == 1:  # the value's type picks the branch: report its deeper error
        return validate(value, typed[0], path)
    for branch in typed:
        try:
            return validate(value, branch, path)
        except SchemaError:
            continue
    raise SchemaError(path, describe(schema), value)


def _type_ok(value, schema: dict) -> bool:
    types = schema["type"]
    return any(_TYPE_CHECKS[t](value) for t in (types if isinstance(types, list) else [types]))


def _number(value, schema: dict, path: str) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise SchemaError(path, "a finite number", value)
    lo, hi, xlo = schema.get("minimum"), schema.get("maximum"), schema.get("exclusiveMinimum")
    if (lo is not None and value < lo) or (hi is not None and value > hi) or (xlo is not None and value <= xlo):
        raise SchemaError(path, describe(schema), value)


def _string(value: str, schema: dict, path: str) -> None:
    hi = schema.get("maxLength")
    if hi is not None and len(value) > hi:
        raise SchemaError(path, f"at most {hi} characters", value, f"{len(value)} characters")
    if len(value) < schema.get("minLength", 0):
        raise SchemaError(path, describe(schema), value)
    pattern = schema.get("pattern")
    if pattern is not None and not re.search(pattern, value):
        raise SchemaError(path, schema.get("description") or f"a string matching {pattern}", value)
    if schema.get("format") == "regex":  # the dialect we accept: Python's `re` syntax
        try:
            re.compile(value)
        except (re.error, RecursionError, OverflowError) as e:
            raise SchemaError(path, "a valid Python regular expression", value, f"{show(value)} ({e})") from None


def _array(value: list, schema: dict, path: str) -> None:
    hi = schema.get("maxItems")
    if hi is not None and len(value) > hi:
        raise SchemaError(path, f"at most {hi} items", value, f"{len(value)} items")
    if len(value) < schema.get("minItems", 0):
        raise SchemaError(path, f"at least {schema['minItems']} item(s)", value)
    items = schema.get("items")
    if items is None:
        return
    if items.get("type") == "integer" and all(type(x) is int for x in value):  # fast path: token ids
        lo, hi = items.get("minimum", -math.inf), items.get("maximum", math.inf)
        if value and (min(value) < lo or max(value) > hi):
            i = next(i for i, x in enumerate(value) if not lo <= x <= hi)
            raise SchemaError(f"{path}[{i}]", describe(items), value[i])
        return
    for i, item in enumerate(value):
        validate(item, items, f"{path}[{i}]")


def _object(value: dict, schema: dict, path: str) -> None:
    hi = schema.get("maxProperties")
    if hi is not None and len(value) > hi:
        raise SchemaError(path, f"at most {hi} entries", value, f"{len(value)} entries")
    props = schema.get("properties", {})
    for key in schema.get("required", ()):
        if value.get(key) is None:
            raise SchemaError(_join(path, key), f"{describe(props.get(key, {}))} (required)", None, "nothing")
    names, extra = schema.get("propertyNames"), schema.get("additionalProperties", True)
    for key, item in value.items():
        if names is not None:
            validate(key, names, _join(path, key))
        if key in props:
            if item is not None:
                validate(item, props[key], _join(path, key))
        elif extra is False:
            known = ", ".join(sorted(k for k, v in props.items() if "type" in v or "anyOf" in v))
            raise SchemaError(_join(path, key), f"a known field ({known})", item, "an unknown field")
        elif isinstance(extra, dict):
            validate(item, extra, _join(path, key))


def describe(schema: dict) -> str:
    """Words for what `schema` accepts: 'an integer in [0, 49151]'."""
    if "description" in schema:
        return schema["description"]
    if "anyOf" in schema:
        return " or ".join(describe(b) for b in schema["anyOf"])
    types = schema.get("type", [])
    names = types if isinstance(types, list) else [types]
    words = " or ".join(_TYPE_WORDS[t] for t in names) or "a value"
    lo, hi, xlo = schema.get("minimum"), schema.get("maximum"), schema.get("exclusiveMinimum")
    if xlo is not None:
        words += f" in ({xlo}, {hi}]" if hi is not None else f" greater than {xlo}"
    elif lo is not None and hi is not None:
        words += f" in [{lo}, {hi}]"
    elif lo is not None:
        words += f" of at least {lo}"
    elif hi is not None:
        words += f" of at most {hi}"
    if "items" in schema:
        words += f" (items: {describe(schema['items'])})"
    if schema.get("minLength"):
        words = "a non-empty string"
    if "enum" in schema:
        words = "one of " + ", ".join(json.dumps(e) for e in schema["enum"])
    return words


def _join(path: str, key: str) -> str:
    if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
        return f"{path}.{key}" if path else key
    return f"{path}[{show(key)}]"
