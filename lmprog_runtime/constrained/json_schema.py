"""JSON Schema -> regex over JSON text (our own translation).

Contract: `build_regex_from_schema(schema)` returns a regex R such that every string
R full-matches is JSON text valid under `schema`, for every keyword we translate.
What cannot be expressed as a regular language is refused with
`UnsupportedSchemaError` whose message names the keyword. Deliberate *narrowings*
(documented in docs/constrained.md) keep R inside the valid set:

- object keys appear in `properties` order, undeclared keys after the declared ones;
  a missing `additionalProperties` is `true` (`extra_properties=True`, the backend's
  default) with values nested at most `extra_depth` levels, or `false` when
  `extra_properties=False`;
- tuple arrays without `additionalItems`/`items` get no extra items (same switch);
- recursion through `$ref` stops after `max_recursion_depth` levels, and `true`
  (any value) nests at most `any_depth` levels;
- numbers under bounds are written without exponent; integers never as `1.0`.
Unknown `format`s are annotations (as in draft 2019+) and are ignored.
"""
from __future__ import annotations

import json
import math
import re
from typing import Any

from lmprog_runtime.constrained import regex_fragments as rx
from lmprog_runtime.constrained.regex_fragments import UnsupportedSchemaError
from lmprog_runtime.constrained.schema_merge import ANNOTATIONS, merge, merge_all, resolve_pointer, type_set

__all__ = ["build_regex_from_schema", "UnsupportedSchemaError", "whitespace_regex", "DEFAULT_MAX_WHITESPACE"]

# Pretty-printed JSON needs "\n" plus the indent of the deepest line; 16 covers indent 2
# down to depth 7 and indent 4 down to depth 3, while still stopping whitespace loops.
DEFAULT_MAX_WHITESPACE = 16
_UNSUPPORTED = ("not", "if", "then", "else", "contains", "$dynamicRef", "$recursiveRef",
                "unevaluatedItems", "minContains", "maxContains")
_OBJECT_KEYS = ("properties", "required", "additionalProperties", "patternProperties",
                "minProperties", "maxProperties", "dependencies", "dependentRequired", "dependentSchemas")
_ARRAY_KEYS = ("items", "prefixItems", "additionalItems", "minItems", "maxItems")
_STRING_KEYS = ("minLength", "maxLength", "pattern", "format")
_NUMBER_KEYS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def whitespace_regex(max_whitespace: int = DEFAULT_MAX_WHITESPACE) -> str:
    return rf"[ \t\n\r]{{0,{max_whitespace}}}" if max_whitespace > 0 else ""


def build_regex_from_schema(schema: Any, whitespace_pattern: str | None = None, *,
                            max_recursion_depth: int = 3, any_depth: int = 3,
                            extra_properties: bool = True, extra_depth: int = 1) -> str:
    """Translate a JSON Schema (dict, bool or JSON text) into a regex over JSON text."""
    if isinstance(schema, (str, bytes)):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise UnsupportedSchemaError(f"schema is not valid JSON: {exc}") from exc
    if not isinstance(schema, (dict, bool)):
        raise UnsupportedSchemaError(f"schema must be an object or a boolean, got {type(schema).__name__}")
    ws = whitespace_regex() if whitespace_pattern is None else whitespace_pattern
    out = _Translator(schema, ws, max_recursion_depth, any_depth, extra_properties, extra_depth).regex(schema)
    if out is None:
        raise UnsupportedSchemaError("schema admits no instance (false schema or contradictory keywords)")
    return out


def _alt(parts: list[str]) -> str:
    parts = list(dict.fromkeys(parts))
    return parts[0] if len(parts) == 1 else "(?:" + "|".join(parts) + ")"


def _literal(value) -> str:
    return rx.escape_literal(json.dumps(value, ensure_ascii=False, separators=(",", ":")))


class _Translator:
    def __init__(self, root, ws: str, max_depth: int, any_depth: int, extra: bool, extra_depth: int = 1):
        self.root, self.ws, self.max_depth, self.any_depth, self.extra = root, ws, max_depth, any_depth, extra
        self.extra_depth = min(extra_depth, any_depth)
        self.sep = f"{ws},{ws}"
        self.colon = f"{ws}:{ws}"
        self.refs: list[str] = []

    # ------------------------------------------------------------------ plumbing
    def flatten(self, schema, used: list[str]):
        """Resolve `$ref` and `allOf` at the top of `schema` into one merged schema."""
        if isinstance(schema, bool):
            return schema
        if not isinstance(schema, dict):
            raise UnsupportedSchemaError(f"subschema must be an object or boolean, got {schema!r:.60}")
        out = {k: v for k, v in schema.items() if k not in ("$ref", "allOf")}
        if "$ref" in schema:
            ref = schema["$ref"]
            if self.refs.count(ref) + used.count(ref) >= self.max_depth:
                return False  # recursion bound reached: this branch is not generated
            used.append(ref)
            out = merge(self.flatten(resolve_pointer(self.root, ref), used), out)
        for sub in schema.get("allOf", []):
            out = merge(out, self.flatten(sub, used))
        return out

    def regex(self, schema) -> str | None:
        """Regex for `schema`, or None when no instance is possible (within our bounds)."""
        used: list[str] = []
        flat = self.flatten(schema, used)
        self.refs.extend(used)
        try:
            return self._regex_flat(flat)
        finally:
            del self.refs[len(self.refs) - len(used):]

    def _regex_flat(self, s) -> str | None:
        if s is True or (isinstance(s, dict) and all(k in ANNOTATIONS for k in s)):
            return self.any_value(self.any_depth)
        if s is False:
            return None
        for key in _UNSUPPORTED:
            if key in s:
                raise UnsupportedSchemaError(f"keyword {key!r} is not supported")
        if "anyOf" in s or "oneOf" in s:
            return self._alternatives(s)
        if "dependencies" in s or "dependentRequired" in s or "dependentSchemas" in s:
            return self._dependencies(s)
        if "const" in s or "enum" in s:
            return self._enum(s)
        types = type_set(s)
        if types is None:
            types = self._infer_types(s)
        if "integer" in types and "number" in types:
            types.discard("integer")
        parts = [p for p in (self._typed(t, s) for t in sorted(types)) if p is not None]
        return _alt(parts) if parts else None

    def _infer_types(self, s) -> set[str]:
        found = set()
        for keys, t in ((_OBJECT_KEYS, "object"), (_ARRAY_KEYS, "array"),
                        (_STRING_KEYS, "string"), (_NUMBER_KEYS, "number")):
            if any(k in s for k in keys):
                found.add(t)
        return found or {"object", "array", "string", "number", "boolean", "null"}

    def _typed(self, t: str, s) -> str | None:
        if t == "object":
            return self._object(s)
        if t == "array":
            return self._array(s)
        if t == "string":
            return self._string(s)
        if t == "integer":
            return self._integer(s)
        if t == "number":
            return self._number(s)
        return rx.BOOLEAN if t == "boolean" else rx.NULL

    def any_value(self, depth: int) -> str:
        scalars = f"{rx.STRING}|{rx.NUMBER}|{rx.BOOLEAN}|{rx.NULL}"
        if depth <= 0:
            return f"(?:{scalars})"
        inner = self.any_value(depth - 1)
        member = f"{rx.STRING}{self.colon}{inner}"
        obj = rf"\{{{self.ws}(?:{member}(?:{self.sep}{member})*{self.ws})?\}}"
        arr = rf"\[{self.ws}(?:{inner}(?:{self.sep}{inner})*{self.ws})?\]"
        return f"(?:{scalars}|{obj}|{arr})"

    # --------------------------------------------------------------- combinators
    def _alternatives(self, s) -> str | None:
        base = {k: v for k, v in s.items() if k not in ("anyOf", "oneOf")}
        groups = [s[k] for k in ("anyOf", "oneOf") if k in s]
        branches = [base]
        for group in groups:
            branches = [{"allOf": [b, g]} for b in branches for g in group]
        if len(branches) > 64:
            raise UnsupportedSchemaError("anyOf/oneOf: too many combined branches")
        parts = [p for p in (self.regex(b) for b in branches) if p is not None]
        if "oneOf" in s and len(parts) > 1:
            _check_disjoint(parts)
        return _alt(parts) if parts else None

    def _dependencies(self, s) -> str | None:
        deps = dict(s.get("dependencies", {}))
        deps.update(s.get("dependentRequired", {}))
        deps.update(s.get("dependentSchemas", {}))
        base = {k: v for k, v in s.items()
                if k not in ("dependencies", "dependentRequired", "dependentSchemas")}
        branches = [base]
        for key, dep in deps.items():
            present = {"required": [key]}
            present = merge(present, {"required": list(dep)} if isinstance(dep, list) else dep)
            absent = {"properties": {key: False}}
            branches = [{"allOf": [b, x]} for b in branches for x in (present, absent)]
            if len(branches) > 64:
                raise UnsupportedSchemaError("dependencies: too many combinations")
        parts = [p for p in (self.regex(b) for b in branches) if p is not None]
        return _alt(parts) if parts else None

    def _enum(self, s) -> str | None:
        values = [s["const"]] if "const" in s else list(s["enum"])
        if "const" in s and "enum" in s:
            values = [v for v in values if v in s["enum"]]
        types = type_set(s)
        if types is not None:
            values = [v for v in values if _json_type(v) & types]
        return _alt([_literal(v) for v in values]) if values else None

    # -------------------------------------------------------------------- object
    def _object(self, s) -> str | None:
        props = dict(s.get("properties", {}))
        required = list(dict.fromkeys(s.get("required", [])))
        pattern_props = s.get("patternProperties", {})
        extra = s.get("additionalProperties", True if self.extra and not pattern_props else False)
        # (with patternProperties, an open default would need "no pattern matches" — a regex
        # complement; undeclared keys then narrow to those the patterns describe)
        if s.get("unevaluatedProperties") is False and "additionalProperties" not in s:
            extra = False
        if pattern_props and extra is not False:
            raise UnsupportedSchemaError("patternProperties together with additionalProperties")
        for name in required:  # a required key the schema never declares: its value is unconstrained
            if name not in props:
                implicit = True if "additionalProperties" not in s and not pattern_props else False
                props[name] = extra if extra is not False else (self._pattern_schema(name, pattern_props)
                                                                 if pattern_props else implicit)
        _check_property_names(s, props, extra, pattern_props)
        items = []
        for name, sub in props.items():
            for pat, psub in pattern_props.items():
                if re.search(pat, name):
                    sub = {"allOf": [sub, psub]}
            value = self.regex(sub)
            if value is None:
                if name in required:
                    return None
                continue
            items.append((f"{_literal(name)}{self.colon}{value}", name in required, False))
        implicit = "additionalProperties" not in s and extra is True  # open by default only
        entry = self._extra_entry(extra, pattern_props, list(props), implicit)
        if entry is not None:
            items.append((entry, False, True))
        n_req = sum(1 for _, req, _ in items if req)
        n_max = math.inf if entry is not None else len(items)
        min_p, max_p = s.get("minProperties", 0), s.get("maxProperties", math.inf)
        if min_p > n_req + (1 if n_req == 0 else 0) and min_p > 1:
            raise UnsupportedSchemaError(f"minProperties {min_p} over optional properties")
        if max_p < n_max:
            if max_p < n_req:
                return None
            raise UnsupportedSchemaError(f"maxProperties {max_p} over optional properties")
        return self._object_body(items, nonempty=min_p >= 1)

    def _pattern_schema(self, name, pattern_props):
        matching = [sub for pat, sub in pattern_props.items() if re.search(pat, name)]
        return merge_all(matching) if matching else False

    def _extra_entry(self, extra, pattern_props, declared, implicit=False) -> str | None:
        if pattern_props:
            parts = []
            for pat, sub in pattern_props.items():
                value = self.regex(sub)
                if value is not None:
                    parts.append(f'"{rx.pattern_to_regex(pat)}"{self.colon}{value}')
            return _alt(parts) if parts else None
        if extra is False:
            return None
        # undeclared keys of an object that merely does not close itself: values nest at
        # most `extra_depth` levels when declared keys exist (any_depth, repeated in each
        # optional-key alternative, would multiply the automaton); a bare object gets any_depth
        depth = self.extra_depth if declared else self.any_depth
        value = self.any_value(depth) if implicit else self.regex(extra)
        return None if value is None else f"{rx.string_not_in(declared)}{self.colon}{value}"

    def _object_body(self, items, nonempty: bool) -> str:
        """`{...}` whose members follow `items` = [(member regex, required, repeatable)]."""
        sep = self.sep

        def tail(i: int) -> str:
            out = []
            for r, req, rep in items[i:]:
                out.append(f"{sep}{r}" if req else f"(?:{sep}{r})" + ("*" if rep else "?"))
            return "".join(out)

        alts, has_required = [], False
        for j, (r, req, rep) in enumerate(items):
            alts.append(r + (f"(?:{sep}{r})*" if rep else "") + tail(j + 1))
            if req:
                has_required = True
                break
        ws = self.ws
        if not alts:
            return rf"\{{{ws}\}}"
        body = _alt(alts)
        if has_required or nonempty:
            return rf"\{{{ws}{body}{ws}\}}"
        return rf"\{{{ws}(?:{body}{ws})?\}}"

    # --------------------------------------------------------------------- array
    def _array(self, s) -> str | None:
        if s.get("uniqueItems") and s.get("maxItems", 2) > 1:
            raise UnsupportedSchemaError("keyword 'uniqueItems' is not supported")
        items = s.get("items", True)
        if "prefixItems" in s:
            prefix, tail = list(s["prefixItems"]), s.get("items", self.extra)
        elif isinstance(items, list):
            prefix, tail = items, s.get("additionalItems", self.extra)
        else:
            prefix, tail = [], items
        lo, hi = s.get("minItems", 0), s.get("maxItems")
        if hi is not None:
            prefix = prefix[:hi]
        regs = []
        for sub in prefix:
            r = self.regex(sub)
            if r is None:
                break
            regs.append(r)
        tail_rx = self.regex(tail) if len(regs) == len(prefix) else None
        return self._array_body(regs, tail_rx, lo, hi)

    def _array_body(self, prefix: list[str], tail: str | None, lo: int, hi: int | None) -> str | None:
        m, sep, ws = len(prefix), self.sep, self.ws
        if tail is None and lo > m:
            return None
        if hi is not None and hi < lo:
            return None
        if m == 0:
            if tail is None or hi == 0:
                return None if lo > 0 else rf"\[{ws}\]"
            rep_hi = "" if hi is None else str(hi - 1)
            body = f"{tail}(?:{sep}{tail}){{{max(lo - 1, 0)},{rep_hi}}}"
            return rf"\[{ws}{body}{ws}\]" if lo > 0 else rf"\[{ws}(?:{body}{ws})?\]"
        if tail is None or (hi is not None and hi <= m):
            node = ""
        else:
            t_hi = "" if hi is None else str(hi - m)
            node = f"(?:{sep}{tail}){{{max(lo - m, 0)},{t_hi}}}"
        for i in range(m - 1, -1, -1):
            node = prefix[i] + node
            if i > 0:
                node = f"{sep}{node}" if i < lo else f"(?:{sep}{node})?"
        return rf"\[{ws}{node}{ws}\]" if lo > 0 else rf"\[{ws}(?:{node}{ws})?\]"

    # ------------------------------------------------------------ string, numbers
    def _string(self, s) -> str | None:
        lo, hi = s.get("minLength", 0), s.get("maxLength")
        if hi is not None and hi < lo:
            return None
        fmt, pattern = s.get("format"), s.get("pattern")
        if fmt in rx.FORMATS and pattern is None:
            if lo or hi is not None:
                raise UnsupportedSchemaError(f"format {fmt!r} together with minLength/maxLength")
            return f'"{rx.FORMATS[fmt]}"'
        if fmt in rx.FORMATS:
            raise UnsupportedSchemaError(f"format {fmt!r} together with pattern")
        count = f"{{{lo},{'' if hi is None else hi}}}"
        if pattern is None:
            return f'"{rx.STRING_CHAR}{count}"'
        if lo or hi is not None:
            width = rx.pattern_width(pattern)
            if width is not None and width[0] >= lo and width[1] is not None and (hi is None or width[1] <= hi):
                return f'"{rx.pattern_to_regex(pattern)}"'
            simple = rx.single_class_repeat(pattern)
            if simple is None:
                raise UnsupportedSchemaError("pattern together with minLength/maxLength")
            char, plo, phi = simple
            new_lo = max(lo, plo)
            new_hi = min(x for x in (hi, phi) if x is not None) if (hi, phi) != (None, None) else None
            if new_hi is not None and new_hi < new_lo:
                return None
            return f'"(?:{char}){{{new_lo},{"" if new_hi is None else new_hi}}}"'
        return f'"{rx.pattern_to_regex(pattern)}"'

    def _bounds(self, s):
        lo, hi = s.get("minimum"), s.get("maximum")
        lo_x = hi_x = False
        emin, emax = s.get("exclusiveMinimum"), s.get("exclusiveMaximum")
        if emin is True:
            lo_x = True
        elif emin is not None and not isinstance(emin, bool) and (lo is None or emin >= lo):
            lo, lo_x = emin, True
        if emax is True:
            hi_x = True
        elif emax is not None and not isinstance(emax, bool) and (hi is None or emax <= hi):
            hi, hi_x = emax, True
        return lo, hi, lo_x, hi_x

    def _integer(self, s) -> str | None:
        mult = s.get("multipleOf")
        if mult is not None and mult != 1:
            raise UnsupportedSchemaError(f"keyword 'multipleOf' ({mult}) is not supported")
        lo, hi, lo_x, hi_x = self._bounds(s)
        ilo = None if lo is None else (math.floor(lo) + 1 if lo_x else math.ceil(lo))
        ihi = None if hi is None else (math.ceil(hi) - 1 if hi_x else math.floor(hi))
        if ilo is not None and ihi is not None and ilo > ihi:
            return None
        return rx.integer_range(ilo, ihi)

    def _number(self, s) -> str | None:
        mult = s.get("multipleOf")
        if mult is not None:
            if mult == 1:
                return self._integer(s)
            raise UnsupportedSchemaError(f"keyword 'multipleOf' ({mult}) is not supported")
        lo, hi, lo_x, hi_x = self._bounds(s)
        if lo is None and hi is None:
            return rx.NUMBER
        return rx.number_range(lo, hi, lo_x, hi_x)


def _json_type(v) -> set[str]:
    if v is None:
        return {"null"}
    if isinstance(v, bool):
        return {"boolean"}
    if isinstance(v, int):
        return {"integer", "number"}
    if isinstance(v, float):
        return {"number", "integer"} if v.is_integer() else {"number"}  # (inf, nan: no integer, no raise)
    if isinstance(v, str):
        return {"string"}
    return {"array"} if isinstance(v, list) else {"object"}


def _check_property_names(s, props, extra, pattern_props):
    names = s.get("propertyNames")
    if names is None or names is True:
        return
    if extra is not False or pattern_props or not isinstance(names, dict):
        raise UnsupportedSchemaError("keyword 'propertyNames' with open-ended keys")
    allowed = set(names) <= {"pattern", "maxLength", "minLength", "enum", "const", "type"}
    if not allowed:
        raise UnsupportedSchemaError("keyword 'propertyNames' with keywords beyond pattern/length/enum")
    for name in list(props):
        ok = (re.search(names.get("pattern", ""), name) is not None
              and names.get("minLength", 0) <= len(name) <= names.get("maxLength", math.inf)
              and ("enum" not in names or name in names["enum"])
              and ("const" not in names or name == names["const"]))
        if not ok:
            props[name] = False


def _check_disjoint(parts: list[str], max_pairs: int = 200_000) -> None:
    """oneOf == anyOf only when no text matches two branches; prove it or refuse.

    Walks the product of the branches' byte DFAs from the start pair: the branches
    overlap iff some reachable pair is accepting in both.
    """
    from lmprog_runtime.constrained.index import ByteDFA

    try:
        dfas = [ByteDFA(rx.ascii_shorthands(p)) for p in parts]
    except Exception as exc:  # noqa: BLE001 - the regex engine refuses a branch
        raise UnsupportedSchemaError(f"oneOf: cannot prove branches disjoint ({exc})") from exc
    for i in range(len(dfas)):
        for j in range(i + 1, len(dfas)):
            if not _disjoint(dfas[i], dfas[j], max_pairs):
                raise UnsupportedSchemaError("oneOf with overlapping branches")


def _disjoint(a, b, max_pairs: int) -> bool:
    seen = {(a.initial, b.initial)}
    todo = [(a.initial, b.initial)]
    while todo:
        x, y = todo.pop()
        if x in a.finals and y in b.finals:
            return False
        nx, ny = a.row(x), b.row(y)
        live = (nx != a.dead) & (ny != b.dead)
        for pair in set(zip(nx[live].tolist(), ny[live].tolist())):
            if pair not in seen:
                seen.add(pair)
                todo.append(pair)
        if len(seen) > max_pairs:
            raise UnsupportedSchemaError("oneOf: cannot prove branches disjoint (automaton too large)")
    return True
