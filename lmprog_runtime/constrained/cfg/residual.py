"""Semantic checks on a complete value's text: the keywords a grammar cannot state
(`not`, `if/then/else`, `oneOf`'s "exactly one", `dependentSchemas`, `contains`, enums of
numbers or objects, ...) are decided by a JSON Schema validator at the moment the value
they apply to is complete, against the subschema in the root's context (so `$ref`s resolve).
`format` is not asserted here (formats are patterns in the grammar, formats.py).
"""
from __future__ import annotations

import json
import threading
from decimal import Decimal

from jsonschema.validators import Draft202012Validator, validator_for
from referencing.jsonschema import DRAFT202012, specification_with


class Residual:
    def __init__(self, root):
        cls = validator_for(root, default=Draft202012Validator) if isinstance(root, dict) else Draft202012Validator
        self._validator = cls(root)
        self._spec = specification_with(cls.META_SCHEMA.get("$schema", ""), default=DRAFT202012)
        self._scopes = _lexical_scopes(root)
        self._lock = threading.Lock()  # the referencing resolver is not documented as thread-safe

    def valid(self, value, schema) -> bool:
        """`value` satisfies `schema` (a subschema of the root, whose `$ref`s resolve from
        the `$id`s around it). A check that cannot be carried out counts as a failure."""
        try:
            with self._lock:
                resolver = self._validator._resolver
                for scope in self._scopes.get(id(schema), ()) + (schema,):
                    if isinstance(scope, dict):
                        resolver = resolver.in_subresource(self._spec.create_resource(scope))
                errors = self._validator.descend(value, schema, resolver=resolver)
                return next(iter(errors), None) is None
        except Exception:  # noqa: BLE001 - an unresolvable reference: never accept what is unchecked
            return False

    def valid_text(self, text: bytes, schema) -> bool:
        try:
            value = json.loads(text.decode("utf-8"))
        except (ValueError, UnicodeDecodeError):
            return False
        return self.valid(value, schema)


def _lexical_scopes(root) -> dict:
    """id(subschema) -> the enclosing subschemas that carry an `$id`, outermost first."""
    out: dict = {}
    stack = [(root, ())]
    while stack and len(out) < 200_000:
        node, chain = stack.pop()
        if isinstance(node, dict):
            out[id(node)] = chain
            inner = chain + (node,) if node is not root and isinstance(node.get("$id"), str) else chain
            stack.extend((v, inner) for v in node.values() if isinstance(v, (dict, list)))
        elif isinstance(node, list):
            stack.extend((v, chain) for v in node if isinstance(v, (dict, list)))
    return out


def _canon(v):
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
        return ("a", tuple(_canon(x) for x in v))
    return ("o", frozenset((k, _canon(x)) for k, x in v.items()))


def canonical(text: bytes):
    """A hashable value of JSON text under JSON Schema equality (1 == 1.0, true != 1)."""
    return _canon(json.loads(text.decode("utf-8"), parse_float=Decimal, parse_int=Decimal))
