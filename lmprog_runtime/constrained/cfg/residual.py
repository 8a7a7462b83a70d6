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


class Residual:
    def __init__(self, root):
        cls = validator_for(root, default=Draft202012Validator) if isinstance(root, dict) else Draft202012Validator
        self._validator = cls(root)
        self._lock = threading.Lock()  # the referencing resolver is not documented as thread-safe

    def valid(self, value, schema) -> bool:
        with self._lock:
            return next(iter(self._validator.descend(value, schema)), None) is None

    def valid_text(self, text: bytes, schema) -> bool:
        try:
            value = json.loads(text.decode("utf-8"))
        except (ValueError, UnicodeDecodeError):
            return False
        return self.valid(value, schema)


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
