"""Schema algebra used by the translator: `$ref` resolution and `allOf` merging.

`merge(a, b)` returns one schema whose instances are those valid under both `a` and
`b` (for the keywords the translator understands), or raises UnsupportedSchemaError
naming the conflict it cannot express.
"""
from __future__ import annotations

from decimal import Decimal
from urllib.parse import unquote

from lmprog_runtime.constrained.regex_fragments import UnsupportedSchemaError

_TYPES = ("object", "array", "string", "integer", "number", "boolean", "null")
_MAX_KEYS = ("maximum", "maxLength", "maxItems", "maxProperties", "exclusiveMaximum")
_MIN_KEYS = ("minimum", "minLength", "minItems", "minProperties", "exclusiveMinimum")
ANNOTATIONS = {"title", "description", "default", "examples", "example", "$schema", "$id", "id",
               "$comment", "readOnly", "writeOnly", "deprecated", "readonly", "contentMediaType",
               "contentEncoding", "definitions", "$defs", "$anchor"}


def resolve_pointer(root, ref: str):
    """Resolve a local `$ref` (`#`, `#/a/b`, `#/definitions/x`) against `root`."""
    if not ref.startswith("#"):
        raise UnsupportedSchemaError(f"$ref {ref!r}: only local references (#/...) are supported")
    path = ref[1:]
    if path in ("", "/"):
        return root
    if not path.startswith("/"):
        raise UnsupportedSchemaError(f"$ref {ref!r}: anchors are not supported")
    return walk_pointer(root, unquote(path), ref)


def walk_pointer(node, pointer: str, ref: str):
    """The value at JSON Pointer `pointer` ("/a/b", percent-decoded as a URI fragment is
    before it is parsed, RFC 6901 §6) under `node`; `ref` names the reference in errors."""
    for raw in pointer[1:].split("/") if pointer else ():
        key = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        elif isinstance(node, dict) and key in node:
            node = node[key]
        else:
            raise UnsupportedSchemaError(f"$ref {ref!r} does not resolve")
    return node


def type_set(schema: dict) -> set[str] | None:
    t = schema.get("type")
    if t is None:
        return None
    types = {t} if isinstance(t, str) else set(t)
    bad = types - set(_TYPES)
    if bad:
        raise UnsupportedSchemaError(f"type {sorted(bad)} is not a JSON Schema type")
    return types


def intersect_types(a: set[str], b: set[str]) -> set[str]:
    """Type names both sets allow (an integer is a number)."""
    out = a & b
    if "integer" in a and "number" in b or "number" in a and "integer" in b:
        out.add("integer")
    return out


def equality_form(v):
    """`v` (a JSON value; numbers may be Decimals) as a hashable form under JSON Schema
    equality: 1 and 1.0 are one number, `true` is not 1 (Python's == says both the other
    way round). Merged enums and a keyword met in two parts are compared this way, and the
    cfg engine's checks compare values so (residual.canonical, uniqueItems)."""
    if isinstance(v, bool):
        return ("b", v)
    if v is None:
        return ("z",)
    if isinstance(v, (int, float, Decimal)):
        d = Decimal(v) if not isinstance(v, float) else Decimal(repr(v))
        return ("n", d.normalize() if d else Decimal(0))
    if isinstance(v, str):
        return ("s", v)
    if isinstance(v, list):
        return ("a", tuple(equality_form(x) for x in v))
    return ("o", frozenset((k, equality_form(x)) for k, x in v.items()))


def merge(a, b):
    """Conjunction of two (already $ref-resolved) schemas."""
    if a is True or a == {}:
        return b
    if b is True or b == {}:
        return a
    if a is False or b is False:
        return False
    out = dict(a)
    for key, bv in b.items():
        if key not in out or key in ANNOTATIONS:
            out.setdefault(key, bv)
            continue
        av = out[key]
        if equality_form(av) == equality_form(bv):
            continue
        out[key] = _merge_key(key, av, bv, a, b)
    if "additionalProperties" in a or "additionalProperties" in b:
        _restrict_extra(out, a, b)
    return out


def _merge_key(key, av, bv, a, b):
    if key == "type":
        ts = intersect_types(type_set(a), type_set(b))
        if not ts:
            raise UnsupportedSchemaError("allOf: the branches' types do not intersect")
        return sorted(ts)
    if key == "properties":
        props = dict(av)
        for k, v in bv.items():
            props[k] = {"allOf": [props[k], v]} if k in props else v
        return props
    if key == "required":
        return list(dict.fromkeys(list(av) + list(bv)))
    if key in _MAX_KEYS and not isinstance(av, bool):
        return min(av, bv)
    if key in _MIN_KEYS and not isinstance(av, bool):
        return max(av, bv)
    if key == "enum":
        keys = {equality_form(v) for v in bv}
        return [v for v in av if equality_form(v) in keys]
    if key in ("items", "additionalProperties", "additionalItems", "not_used"):
        if isinstance(av, list) or isinstance(bv, list):
            raise UnsupportedSchemaError(f"allOf: conflicting tuple {key}")
        return {"allOf": [av, bv]}
    if key == "patternProperties":
        props = dict(av)
        for k, v in bv.items():
            props[k] = {"allOf": [props[k], v]} if k in props else v
        return props
    if key in ("anyOf", "oneOf"):
        combos = [{"allOf": [x, y]} for x in av for y in bv]
        if len(combos) > 64:
            raise UnsupportedSchemaError(f"allOf: {key} cross product too large")
        return combos
    if key == "allOf":
        return list(av) + list(bv)
    raise UnsupportedSchemaError(f"allOf: conflicting values for {key!r}")


def _restrict_extra(out, a, b):
    """A key declared by only one branch must satisfy the other's additionalProperties."""
    props = dict(out.get("properties", {}))
    for this, other in ((a, b), (b, a)):
        extra = other.get("additionalProperties", True) if isinstance(other, dict) else True
        if extra is True or "patternProperties" in other:
            continue
        declared = other.get("properties", {})
        for k in list(props):
            if k in declared or k not in this.get("properties", {}):
                continue
            props[k] = False if extra is False else {"allOf": [props[k], extra]}
    out["properties"] = props


def merge_all(schemas):
    out = True
    for s in schemas:
        out = merge(out, s)
    return out
