"""Compiled checks: a JSON Schema 2020-12 subschema as a Python predicate over a decoded JSON
value, for the residual's checks (residual.py) on the mask's path. The answer is the
validator's (jsonschema's Draft202012Validator, whose format checker asserts the formats the
grammar asserts: formats.format_checks) on every schema compiled here; it is only reached faster (a check through
jsonschema costs 15-180 µs, most of it its generic descent; a compiled one a few).

Each keyword is tested in the order the schema writes them, as the validator does; a check
that raises (a number too large for its float arithmetic, a recursion limit) is answered by
the validator instead (Residual.valid). `unevaluatedProperties` / `unevaluatedItems` see the
keys / items their in-place siblings evaluate (properties, patterns, additional and
unevaluated keywords, prefixItems, items, contains, $ref, dependentSchemas, the valid
branches of allOf / anyOf / oneOf, if / then / else), per JSON Schema 2020-12 11.2 / 11.3.

References are resolved at compile time by the resolver the validator would hold there
(`referencing`'s, with its dynamic scope: the base URIs the evaluation came through), so a
`$dynamicRef` compiles to the target its path of evaluation gives it; a rule is compiled once
per subschema, base URI and dynamic scope (its distinct URIs, outermost kept: a dynamic anchor
resolves to the outermost scope that has it, so that keeps the answer and bounds recursion).

Not compiled (`Compiler.check` returns None; the validator decides): another dialect, a
reference that does not resolve locally, a pattern Python's `re` refuses, an unknown type name. Equality (`const`,
`enum`, `uniqueItems`) is JSON's: numbers by value (1 == 1.0), booleans apart from numbers,
arrays and objects member by member.
"""
from __future__ import annotations

import re
import threading
from fractions import Fraction
from typing import Any, Callable, Optional

import attrs
import rpds

DIALECT = "https://json-schema.org/draft/2020-12/schema"
MAX_RULES = 4096  # compiled rules per Compiler (subschema x base URI x dynamic scope), then the validator
_RECURSIVE = ("$recursiveRef", "$recursiveAnchor")  # (draft 2019-09's)


class Unsupported(Exception):
    """The schema is left to the validator."""


# ------------------------------------------------------------------ values
def _is_number(v) -> bool:
    t = type(v)
    return t is int or t is float


def _is_integer(v) -> bool:
    t = type(v)
    return t is int or (t is float and v.is_integer())


_TYPES = {"null": lambda v: v is None, "boolean": lambda v: type(v) is bool, "object": lambda v: type(v) is dict,
          "array": lambda v: type(v) is list, "string": lambda v: type(v) is str, "number": _is_number,
          "integer": _is_integer}


def equal(a, b) -> bool:
    """JSON equality: booleans apart from numbers, numbers by value, containers member-wise."""
    if a is b:
        return True
    ta, tb = type(a), type(b)
    if ta is str or tb is str:
        return a == b
    if ta is list and tb is list:
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
    if ta is dict and tb is dict:
        return len(a) == len(b) and all(k in b and equal(x, b[k]) for k, x in a.items())
    if ta is bool or tb is bool:
        return False  # (`a is b` above: the same boolean)
    if ta in (list, dict) or tb in (list, dict):
        return False
    return a == b


def unique(items: list) -> bool:
    for i in range(1, len(items)):
        x = items[i]
        for j in range(i):
            if equal(items[j], x):
                return False
    return True


def multiple_of(v, step) -> bool:
    """v is a multiple of `step`, in the validator's arithmetic (a float step: the quotient's
    float is whole, exact fractions where it overflows)."""
    if type(step) is float:
        q = v / step
        try:
            return int(q) == q
        except OverflowError:
            return (Fraction(v) / Fraction(step)).denominator == 1
    return not (v % step)


# ------------------------------------------------------------------ rules
class _Rule:
    """One subschema under one base URI: `ok` its predicate, and what the unevaluated*
    keywords read of it (its evaluated keys and items: `keys`, `items`)."""

    __slots__ = ("schema", "tests", "ok", "refs", "props", "patterns", "more", "dep_schemas", "all", "any", "one",
                 "if_", "then", "else_", "prefix", "every_item", "contains")

    def __init__(self, schema):
        self.schema = schema
        self.tests: list = []
        self.if_ = self.then = self.else_ = self.contains = None
        self.refs: list = []  # $ref / $dynamicRef targets
        self.props: frozenset = frozenset()
        self.patterns: list = []
        self.more: list = []  # additionalProperties / unevaluatedProperties rules (keys valid under them)
        self.dep_schemas: list = []
        self.all, self.any, self.one = [], [], []
        self.prefix, self.every_item = 0, False
        tests = self.tests

        def ok(v) -> bool:
            for t in tests:
                if not t(v):
                    return False
            return True
        self.ok = ok

    def keys(self, v: dict) -> set:
        """The keys of object v this rule's in-place keywords evaluate."""
        out = set(self.props.intersection(v))
        for r in self.refs:
            out |= r.keys(v)
        for r in self.more:
            out.update(k for k, x in v.items() if r.ok(x))
        for p in self.patterns:
            out.update(k for k in v if p(k))
        for name, r in self.dep_schemas:
            if name in v:
                out |= r.keys(v)
        for r in (*self.all, *self.any, *self.one):
            if r.ok(v):
                out |= r.keys(v)
        self._conditional(v, out, "keys")
        return out

    def items(self, v: list) -> set:
        """The indexes of array v this rule's in-place keywords evaluate."""
        if self.every_item:
            return set(range(len(v)))
        out = set(range(min(self.prefix, len(v))))
        for r in self.refs:
            out |= r.items(v)
        self._conditional(v, out, "items")
        for r in self.contains or ():
            out.update(k for k, x in enumerate(v) if r.ok(x))
        for r in (*self.all, *self.any, *self.one):
            if r.ok(v):
                out |= r.items(v)
        return out

    def _conditional(self, v, out: set, part: str) -> None:
        if self.if_ is None:
            return
        if self.if_.ok(v):
            out |= getattr(self.if_, part)(v)
            if self.then is not None:
                out |= getattr(self.then, part)(v)
        elif self.else_ is not None:
            out |= getattr(self.else_, part)(v)


class Cycle(Exception):
    """A check met a rule again on the value that rule is evaluating: it would never return
    (the validator's RecursionError). Residual.valid counts it as a failure."""


_ACTIVE = threading.local()  # .on: the (rule, value) pairs whose back references are being followed


class _Back:
    """A reference back to a rule being made for the same value (an in-place cycle: `$ref:
    #` at the root, `if ... then: {$ref: #}`): followed as the rule, but met again on a value
    it is already following there, it raises Cycle. Compiled to C a test that calls itself
    does not raise RecursionError, it runs past the thread's stack (the process dies); and
    the validator took ~1000 frames to fail each such value."""

    __slots__ = ("target", "ok")

    def __init__(self, target: _Rule):
        self.target = target
        self.ok = lambda v: self._follow("ok", v)

    def keys(self, v) -> set:
        return self._follow("keys", v)

    def items(self, v) -> set:
        return self._follow("items", v)

    def _follow(self, part: str, v):
        on = getattr(_ACTIVE, "on", None)
        if on is None:
            on = _ACTIVE.on = set()
        key = (id(self.target), id(v), part)
        if key in on:
            raise Cycle
        on.add(key)
        try:
            return getattr(self.target, part)(v)
        finally:
            on.discard(key)


_ALWAYS = _Rule(True)
_NEVER = _Rule(False)
_NEVER.tests.append(lambda v: False)


class Compiler:
    """The compiled rules of one document (and what it references), shared by its checks;
    not thread-safe (Residual holds its lock around `check`)."""

    def __init__(self, spec, formats: Optional[dict] = None):
        """formats: format -> test of a value, the asserted ones (formats.format_checks)."""
        self.spec = spec
        self.formats = formats or {}
        self.memo: dict = {}  # (id(schema), base URI, dynamic scope) -> _Rule (filled after it is entered: recursion)
        self.keep: list = []  # the schemas keyed by id
        self._here: list = []  # the keys of the rules being made for one value (in place), outermost first

    def check(self, schema, resolver) -> Optional[Callable[[Any], bool]]:
        """The predicate of `schema` whose `$ref`s resolve with `resolver` (a `referencing`
        resolver, as the validator's for it), or None where it is not compiled."""
        before = set(self.memo)
        try:
            return self.rule(schema, resolver).ok
        except Exception:  # noqa: BLE001 - Unsupported, a recursion limit: the validator decides
            for key in set(self.memo) - before:  # (rules left half-filled)
                del self.memo[key]
            return None

    def rule(self, schema, resolver) -> _Rule:
        """`schema` evaluated with `resolver` as it is (the validator's `evolve` and a
        resolved `$ref`; `sub` for its in-place descent)."""
        if schema is True:
            return _ALWAYS
        if schema is False:
            return _NEVER
        if not isinstance(schema, dict):
            raise Unsupported("a schema is an object or a boolean")
        scope = _outermost(resolver._previous)
        if len(scope) != len(resolver._previous):
            resolver = attrs.evolve(resolver, previous=rpds.List(scope))
        key = (id(schema), resolver._base_uri, scope)
        got = self.memo.get(key)
        if got is not None:
            if key in self._here:  # (a test that calls itself on the same value: it may never return)
                return _Back(got)
            return got
        if any(k in schema for k in _RECURSIVE) or schema.get("$schema", DIALECT) != DIALECT:
            raise Unsupported("recursive references or another dialect")
        if len(self.memo) >= MAX_RULES:
            raise Unsupported("too many rules")
        r = self.memo[key] = _Rule(schema)
        self.keep.append(schema)
        self._here.append(key)
        try:
            for word, value in schema.items():
                if word == "format" and value in self.formats:
                    r.tests.append(self.formats[value])  # (a non-string passes it)
                    continue
                make = _KEYWORDS.get(word)
                if make is not None:
                    test = make(self, r, value, schema, resolver)
                    if test is not None:
                        r.tests.append(test)
        finally:
            self._here.pop()
        return r

    def sub(self, schema, resolver) -> _Rule:
        """A subschema the validator descends into (its `$id`, if any, a new base URI)."""
        if isinstance(schema, dict) and "$id" in schema:
            resolver = resolver.in_subresource(self.spec.create_resource(schema))
        return self.rule(schema, resolver)

    def child(self, schema, resolver, new_base: bool = True) -> _Rule:
        """The rule of a member's or an item's values (`sub`; `rule` where not `new_base`):
        a reference back to a rule being made is recursion into the value, not a cycle."""
        here, self._here = self._here, []
        try:
            return self.sub(schema, resolver) if new_base else self.rule(schema, resolver)
        finally:
            self._here = here


def _outermost(previous) -> tuple:
    """The dynamic scope's URIs (most recent first), each once where it is outermost."""
    out = list(previous)
    if len(set(out)) == len(out):
        return tuple(out)
    seen: set = set()
    kept = [u for u in reversed(out) if not (u in seen or seen.add(u))]
    return tuple(reversed(kept))


def _pattern(p) -> Callable[[str], Any]:
    if not isinstance(p, str):
        raise Unsupported("a pattern is a string")
    try:
        return re.compile(p).search
    except (re.error, RecursionError, OverflowError):
        raise Unsupported("a pattern Python's re refuses") from None


# ------------------------------------------------------------------ keywords
# each: (compiler, rule, keyword value, schema, resolver) -> test(v) -> passes, or None

def _type(c, r, value, schema, res):
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not all(isinstance(n, str) and n in _TYPES for n in names):
        raise Unsupported("an unknown type")
    tests = [_TYPES[n] for n in names]
    if len(tests) == 1:
        return tests[0]
    return lambda v: any(t(v) for t in tests)


def _const(c, r, value, schema, res):
    return lambda v: equal(v, value)


def _enum(c, r, value, schema, res):
    if not isinstance(value, list):
        raise Unsupported("enum is an array")
    if value and all(type(e) is str for e in value):
        names = frozenset(value)
        return lambda v: type(v) is str and v in names
    return lambda v: any(equal(e, v) for e in value)


def _bound(cmp):
    def make(c, r, value, schema, res):
        if not _is_number(value):
            raise Unsupported("a bound is a number")
        return lambda v: not _is_number(v) or cmp(v, value)
    return make


def _multiple(c, r, value, schema, res):
    if not _is_number(value) or value <= 0:
        raise Unsupported("multipleOf is a positive number")
    return lambda v: not _is_number(v) or multiple_of(v, value)


def _length(kind, size, cmp):
    def make(c, r, value, schema, res):
        if type(value) is not int:
            if not (type(value) is float and value.is_integer()):
                raise Unsupported("a length bound is an integer")
        return lambda v: type(v) is not kind or cmp(size(v), value)
    return make


def _pattern_kw(c, r, value, schema, res):
    search = _pattern(value)
    return lambda v: type(v) is not str or search(v) is not None


def _properties(c, r, value, schema, res):
    if not isinstance(value, dict):
        raise Unsupported("properties is an object")
    pairs = [(name, c.child(s, res)) for name, s in value.items()]
    r.props = frozenset(value)

    def test(v):
        if type(v) is not dict:
            return True
        for name, rule in pairs:
            if name in v and not rule.ok(v[name]):
                return False
        return True
    return test


def _pattern_properties(c, r, value, schema, res):
    if not isinstance(value, dict):
        raise Unsupported("patternProperties is an object")
    pairs = [(_pattern(p), c.child(s, res)) for p, s in value.items()]
    r.patterns = [p for p, _ in pairs]

    def test(v):
        if type(v) is not dict:
            return True
        for search, rule in pairs:
            for k, x in v.items():
                if search(k) is not None and not rule.ok(x):
                    return False
        return True
    return test


def _additional(c, r, value, schema, res):
    props = schema.get("properties", {})
    props = frozenset(props) if isinstance(props, dict) else frozenset()
    pats = schema.get("patternProperties", {})
    searches = [_pattern(p) for p in pats] if isinstance(pats, dict) else []
    rule = c.child(value, res)
    r.more.append(rule)

    def test(v):
        if type(v) is not dict:
            return True
        for k, x in v.items():
            if k not in props and not any(s(k) is not None for s in searches) and not rule.ok(x):
                return False
        return True
    return test


def _unevaluated_properties(c, r, value, schema, res):
    rule = c.child(value, res)
    r.more.append(rule)

    def test(v):
        if type(v) is not dict:
            return True
        seen = r.keys(v)  # (keys valid under `rule` among them)
        return all(k in seen for k in v)
    return test


def _required(c, r, value, schema, res):
    if not isinstance(value, list):
        raise Unsupported("required is an array")
    return lambda v: type(v) is not dict or all(k in v for k in value)


def _dependent_required(c, r, value, schema, res):
    if not isinstance(value, dict):
        raise Unsupported("dependentRequired is an object")
    pairs = list(value.items())
    return lambda v: type(v) is not dict or all(name not in v or all(k in v for k in need) for name, need in pairs)


def _dependent_schemas(c, r, value, schema, res):
    if not isinstance(value, dict):
        raise Unsupported("dependentSchemas is an object")
    pairs = r.dep_schemas = [(name, c.sub(s, res)) for name, s in value.items()]
    return lambda v: type(v) is not dict or all(name not in v or rule.ok(v) for name, rule in pairs)


def _property_names(c, r, value, schema, res):
    rule = c.child(value, res)
    return lambda v: type(v) is not dict or all(rule.ok(k) for k in v)


def _prefix_items(c, r, value, schema, res):
    if not isinstance(value, list):
        raise Unsupported("prefixItems is an array")
    rules = [c.child(s, res) for s in value]
    r.prefix = len(rules)
    return lambda v: type(v) is not list or all(rule.ok(x) for rule, x in zip(rules, v))


def _items(c, r, value, schema, res):
    prefix = schema.get("prefixItems", [])
    start = len(prefix) if isinstance(prefix, list) else 0
    rule = c.child(value, res)
    r.every_item = True
    return lambda v: type(v) is not list or all(rule.ok(x) for x in v[start:])


def _contains(c, r, value, schema, res):
    rule = c.child(value, res, False)  # (the validator evolves into it: no new base URI)
    r.contains = (r.contains or ()) + (rule,)
    least, most = schema.get("minContains", 1), schema.get("maxContains")
    if not _is_number(least) or (most is not None and not _is_number(most)):
        raise Unsupported("minContains / maxContains are numbers")

    def test(v):
        if type(v) is not list:
            return True
        top = len(v) if most is None else most
        n = 0
        for x in v:
            if rule.ok(x):
                n += 1
                if n > top:
                    return False
        return n >= least
    return test


def _unevaluated_items(c, r, value, schema, res):
    rule = c.child(value, res, False)  # (the validator evolves into it to find the items it evaluates)
    r.contains = (r.contains or ()) + (rule,)

    def test(v):
        if type(v) is not list:
            return True
        return len(r.items(v)) == len(v)
    return test


def _unique(c, r, value, schema, res):
    if not value:
        return None
    return lambda v: type(v) is not list or unique(v)


def _all_of(c, r, value, schema, res):
    rules = r.all = _branches(c, value, res)
    return lambda v: all(rule.ok(v) for rule in rules)


def _any_of(c, r, value, schema, res):
    rules = r.any = _branches(c, value, res)
    return lambda v: any(rule.ok(v) for rule in rules)


def _one_of(c, r, value, schema, res):
    rules = r.one = _branches(c, value, res)
    # (the validator evolves into the branches after the first valid one: the same base URI)
    later = [c.rule(s, res) for s in value]

    def test(v):
        for i, rule in enumerate(rules):
            if rule.ok(v):
                return not any(x.ok(v) for x in later[i + 1:])
        return False
    return test


def _branches(c, value, res) -> list:
    if not isinstance(value, list) or not value:
        raise Unsupported("a non-empty array of schemas")
    return [c.sub(s, res) for s in value]


def _not(c, r, value, schema, res):
    rule = c.rule(value, res)
    return lambda v: not rule.ok(v)


def _if(c, r, value, schema, res):
    cond = r.if_ = c.rule(value, res)
    then = r.then = c.sub(schema["then"], res) if "then" in schema else None
    other = r.else_ = c.sub(schema["else"], res) if "else" in schema else None

    def test(v):
        if cond.ok(v):
            return then is None or then.ok(v)
        return other is None or other.ok(v)
    return test


def _ref(c, r, value, schema, res):
    if not isinstance(value, str):
        raise Unsupported("a reference is a string")
    try:
        got = res.lookup(value)
    except Exception:  # noqa: BLE001 - unresolvable here: the validator decides (it fails the check)
        raise Unsupported("an unresolved $ref") from None
    target = c.rule(got.contents, got.resolver)
    r.refs.append(target)
    return target.ok


_KEYWORDS = {
    "type": _type, "const": _const, "enum": _enum,
    "minimum": _bound(lambda v, b: v >= b), "maximum": _bound(lambda v, b: v <= b),
    "exclusiveMinimum": _bound(lambda v, b: v > b), "exclusiveMaximum": _bound(lambda v, b: v < b),
    "multipleOf": _multiple,
    "minLength": _length(str, len, lambda n, b: n >= b), "maxLength": _length(str, len, lambda n, b: n <= b),
    "minItems": _length(list, len, lambda n, b: n >= b), "maxItems": _length(list, len, lambda n, b: n <= b),
    "minProperties": _length(dict, len, lambda n, b: n >= b), "maxProperties": _length(dict, len, lambda n, b: n <= b),
    "pattern": _pattern_kw, "properties": _properties, "patternProperties": _pattern_properties,
    "additionalProperties": _additional, "unevaluatedProperties": _unevaluated_properties,
    "required": _required, "dependentRequired": _dependent_required, "dependentSchemas": _dependent_schemas,
    "propertyNames": _property_names, "prefixItems": _prefix_items, "items": _items, "contains": _contains,
    "unevaluatedItems": _unevaluated_items, "uniqueItems": _unique,
    "allOf": _all_of, "anyOf": _any_of, "oneOf": _one_of, "not": _not, "if": _if, "$ref": _ref, "$dynamicRef": _ref,
}
