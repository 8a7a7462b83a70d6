"""Regex fragments for JSON text: strings, ECMA `pattern`s, numbers with bounds, formats.

Every fragment is written in the dialect shared by Rust `regex` (outlines-core's byte
DFA) and Python `re` (tests): literal characters, `[...]`
classes with `\\xHH` escapes, `(?:...)`, `|`, `*+?{m,n}`. No `\\d`/`\\w` (Rust's are
Unicode-wide), no `\\u` escapes, no lookaround. Each fragment matches JSON *text*
(so a string value includes its quotes and escapes).
"""
from __future__ import annotations

import re

try:  # Python 3.11+
    import re._parser as sre_parse  # type: ignore[import-not-found]
    import re._constants as sre_c  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - Python 3.10
    import sre_constants as sre_c  # type: ignore[no-redef]
    import sre_parse  # type: ignore[no-redef]


class UnsupportedSchemaError(ValueError):
    """The schema uses a feature that cannot be expressed as a regular language."""


# One JSON-string character as it appears in JSON text (unescaped or escaped).
STRING_CHAR = r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})'
STRING = f'"{STRING_CHAR}*"'
INTEGER = r"-?(?:0|[1-9][0-9]*)"
NUMBER = r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"
BOOLEAN = r"(?:true|false)"
NULL = "null"

_META = set(".^$*+?{}[]|()\\")
_JSON_SHORT = {'"': '\\\\"', "\\": "\\\\\\\\", "\b": "\\\\b", "\f": "\\\\f",
               "\n": "\\\\n", "\r": "\\\\r", "\t": "\\\\t"}


def escape_literal(text: str) -> str:
    """Regex matching exactly `text` (characters outside printable ASCII stay literal)."""
    out = []
    for ch in text:
        if ch in _META:
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return "".join(out)


def json_char(ch: str) -> str:
    """Regex for one decoded string character as JSON text (canonical json.dumps form)."""
    if ch in _JSON_SHORT:
        return _JSON_SHORT[ch]
    if ord(ch) < 0x20:
        return f"\\\\u00{ord(ch):02x}"
    return escape_literal(ch)


# --------------------------------------------------------------------------- formats
_DATE = r"[0-9]{4}-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12][0-9]|3[01])"
_TIME = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:(?:[0-5][0-9]|60)(?:\.[0-9]+)?(?:[Zz]|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_IPV4 = rf"{_OCTET}(?:\.{_OCTET}){{3}}"
_H16 = r"[0-9a-fA-F]{1,4}"
_IPV6 = "(?:" + "|".join([
    rf"(?:{_H16}:){{7}}{_H16}",
    rf"(?:{_H16}:){{1,7}}:",
    rf"(?:{_H16}:){{1,6}}:{_H16}",
    rf"(?:{_H16}:){{1,5}}(?::{_H16}){{1,2}}",
    rf"(?:{_H16}:){{1,4}}(?::{_H16}){{1,3}}",
    rf"(?:{_H16}:){{1,3}}(?::{_H16}){{1,4}}",
    rf"(?:{_H16}:){{1,2}}(?::{_H16}){{1,5}}",
    rf"{_H16}:(?::{_H16}){{1,6}}",
    rf":(?:(?::{_H16}){{1,7}}|:)",
]) + ")"
_LABEL = r"[a-zA-Z0-9](?:[a-zA-Z0-9-]{0,61}[a-zA-Z0-9])?"
_HOSTNAME = rf"{_LABEL}(?:\.{_LABEL})*"
FORMATS = {
    "date": _DATE,
    "time": _TIME,
    "date-time": rf"{_DATE}[Tt]{_TIME}",
    "email": r"[a-zA-Z0-9.!#$%&'*+=?^_`{|}~-]+@" + _HOSTNAME,
    "uuid": r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}",
    "uri": r"[a-zA-Z][a-zA-Z0-9+.-]*:[^\x00-\x20\"\\<>^`{|}]*",
    "ipv4": _IPV4,
    "ipv6": _IPV6,
    "hostname": _HOSTNAME,
}
FORMATS["uri-reference"] = r"[^\x00-\x20\"\\<>^`{|}]*"
FORMATS["iri"] = FORMATS["uri"]
FORMATS["idn-hostname"] = _HOSTNAME
FORMATS["idn-email"] = FORMATS["email"]


# ------------------------------------------------------------------ ECMA `pattern`
_MAXCP = 0x10FFFF
_SPACE = [(9, 13), (32, 32), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A), (0x2028, 0x2029),
          (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000), (0xFEFF, 0xFEFF)]
_CATEGORIES = {  # ECMA semantics (ASCII \d \w)
    "CATEGORY_DIGIT": [(48, 57)],
    "CATEGORY_WORD": [(48, 57), (65, 90), (95, 95), (97, 122)],
    "CATEGORY_SPACE": _SPACE,
}


def _normalize(ranges):
    out = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _complement(ranges):
    out, prev = [], 0
    for lo, hi in _normalize(ranges):
        if lo > prev:
            out.append((prev, lo - 1))
        prev = hi + 1
    if prev <= _MAXCP:
        out.append((prev, _MAXCP))
    return out


def _category(name: str):
    neg = name.startswith("CATEGORY_NOT_")
    base = name.replace("CATEGORY_NOT_", "CATEGORY_")
    if base not in _CATEGORIES:
        raise UnsupportedSchemaError(f"pattern: character category {name}")
    rng = _CATEGORIES[base]
    return _complement(rng) if neg else list(rng)


def _class_char(cp: int) -> str:
    ch = chr(cp)
    if cp < 0x20 or cp == 0x7F:
        return f"\\x{cp:02x}"
    return "\\" + ch if ch in "\\]^-[" else ch


def ranges_to_json_regex(ranges) -> str:
    """Regex for one character drawn from code-point `ranges`, as JSON string text."""
    ranges = _normalize(ranges)
    plain, special = [], []
    specials = [cp for lo, hi in ranges for cp in range(lo, min(hi, 0x5C) + 1)
                if cp < 0x20 or cp in (0x22, 0x5C)]
    if len(specials) == 34:  # every escaped character: the compact escape forms
        special = [r'\\["\\bfnrt]', r"\\u00[01][0-9a-fA-F]"]
    else:
        special = [json_char(chr(cp)) for cp in specials]
    for lo, hi in ranges:
        for a, b in ((0x20, 0x21), (0x23, 0x5B), (0x5D, 0xD7FF), (0xE000, _MAXCP)):
            s, e = max(lo, a), min(hi, b)
            if s <= e:
                plain.append(_class_char(s) if s == e else f"{_class_char(s)}-{_class_char(e)}")
    alts = ([f"[{''.join(plain)}]"] if plain else []) + special
    if not alts:
        raise UnsupportedSchemaError("pattern: empty character class")
    return alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"


def _in_ranges(items):
    ranges, negate = [], False
    for op, av in items:
        name = str(op)
        if name == "NEGATE":
            negate = True
        elif name == "LITERAL":
            ranges.append((av, av))
        elif name == "RANGE":
            ranges.append(av)
        elif name == "CATEGORY":
            ranges.extend(_category(str(av)))
        else:
            raise UnsupportedSchemaError(f"pattern: class item {name}")
    return _complement(ranges) if negate else ranges


def _emit(seq) -> str:
    out = []
    for op, av in seq:
        name = str(op)
        if name == "LITERAL":
            out.append(json_char(chr(av)))
        elif name == "NOT_LITERAL":
            out.append(ranges_to_json_regex(_complement([(av, av)])))
        elif name == "ANY":
            out.append(ranges_to_json_regex(_complement([(10, 10), (13, 13), (0x2028, 0x2029)])))
        elif name == "IN":
            out.append(ranges_to_json_regex(_in_ranges(av)))
        elif name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
            lo, hi, sub = av
            body = _emit(sub)
            hi_s = "" if hi == sre_c.MAXREPEAT else str(hi)
            out.append(f"(?:{body}){{{lo},{hi_s}}}" if lo != hi else f"(?:{body}){{{lo}}}")
        elif name == "SUBPATTERN":
            out.append(f"(?:{_emit(av[-1])})")
        elif name == "ATOMIC_GROUP":
            out.append(f"(?:{_emit(av)})")
        elif name == "BRANCH":
            out.append("(?:" + "|".join(_emit(b) for b in av[1]) + ")")
        elif name == "AT":
            raise UnsupportedSchemaError(f"pattern: anchor {av} inside the pattern")
        elif name == "CATEGORY":
            out.append(ranges_to_json_regex(_category(str(av))))
        else:
            raise UnsupportedSchemaError(f"pattern: regex construct {name} (lookaround/backreference)")
    return "".join(out)


def _strip_anchors(seq):
    items = list(seq)
    start = bool(items) and str(items[0][0]) == "AT" and str(items[0][1]) == "AT_BEGINNING"
    if start:
        items = items[1:]
    end = bool(items) and str(items[-1][0]) == "AT" and str(items[-1][1]) in ("AT_END", "AT_END_STRING")
    if end:
        items = items[:-1]
    return items, start, end


def _parse(pattern: str):
    if re.search(r"\\[pPk]|\(\?<[=!]|\(\?[=!]", pattern):
        raise UnsupportedSchemaError(f"pattern {pattern!r}: unicode property or lookaround")
    py = re.sub(r"\(\?<(?=[A-Za-z_])", "(?P<", pattern)
    try:
        return sre_parse.parse(py)
    except Exception as exc:  # noqa: BLE001 - any parse failure is the schema's fault
        raise UnsupportedSchemaError(f"pattern {pattern!r} does not parse: {exc}") from exc


def _branches(parsed):
    """Top-level alternatives, descending into a lone group `^(a|b)$`-style wrapper."""
    seq = list(parsed)
    if len(seq) == 1 and str(seq[0][0]) == "BRANCH":
        return [list(b) for b in seq[0][1][1]]
    return [seq]


def pattern_to_regex(pattern: str) -> str:
    """JSON-text regex for the *inside* of a string whose value `re.search`es `pattern`."""
    parts = []
    for branch in _branches(_parse(pattern)):
        items, start, end = _strip_anchors(branch)
        body = _emit(items)
        parts.append(("" if start else f"{STRING_CHAR}*") + body + ("" if end else f"{STRING_CHAR}*"))
    return parts[0] if len(parts) == 1 else "(?:" + "|".join(parts) + ")"


def pattern_width(pattern: str):
    """(min, max) length in characters of a fully anchored pattern's matches, else None."""
    parsed = _parse(pattern)
    for branch in _branches(parsed):
        _, start, end = _strip_anchors(branch)
        if not (start and end):
            return None
    lo, hi = parsed.getwidth()
    return lo, (None if hi >= sre_c.MAXREPEAT else hi)


def single_class_repeat(pattern: str):
    """For `^C+$` / `^C*$` / `^C{m,n}$` with C one character class: (C-regex, m, n)."""
    items, start, end = _strip_anchors(list(_parse(pattern)))
    if not (start and end and len(items) == 1 and str(items[0][0]) in ("MAX_REPEAT", "MIN_REPEAT")):
        return None
    lo, hi, sub = items[0][1]
    sub = list(sub)
    if len(sub) != 1 or str(sub[0][0]) not in ("IN", "LITERAL", "ANY", "NOT_LITERAL", "CATEGORY"):
        return None
    return _emit(sub), lo, (None if hi == sre_c.MAXREPEAT else hi)


# ---------------------------------------------------------------- integer ranges
def _same_len(a: str, b: str) -> str:
    if a == b:
        return a
    if len(a) == 1:
        return f"[{a}-{b}]"
    if a[0] == b[0]:
        return a[0] + _same_len(a[1:], b[1:])
    n = len(a) - 1
    parts, start, end = [], int(a[0]), int(b[0])
    if a[1:] != "0" * n:
        parts.append(a[0] + _same_len(a[1:], "9" * n))
        start += 1
    tail = None
    if b[1:] != "9" * n:
        tail = b[0] + _same_len("0" * n, b[1:])
        end -= 1
    if start <= end:
        head = str(start) if start == end else f"[{start}-{end}]"
        parts.append(f"{head}[0-9]{{{n}}}")
    if tail:
        parts.append(tail)
    return parts[0] if len(parts) == 1 else "(?:" + "|".join(parts) + ")"


def _nonneg_range(lo: int, hi: int | None) -> list[str]:
    """Alternatives matching decimal naturals in [lo, hi] (hi None = unbounded)."""
    if hi is not None and lo > hi:
        return []
    top = hi if hi is not None else 10 ** len(str(lo)) - 1
    parts = []
    for d in range(len(str(lo)), len(str(top)) + 1):
        a = max(lo, 10 ** (d - 1) if d > 1 else 0)
        b = min(top, 10**d - 1)
        if a <= b:
            parts.append(_same_len(str(a), str(b)))
    if hi is None:
        parts.append(f"[1-9][0-9]{{{len(str(lo))},}}")
    return parts


def integer_range(lo: int | None, hi: int | None) -> str | None:
    """Regex for JSON integers in [lo, hi]; None when the range is empty."""
    if lo is None and hi is None:
        return INTEGER
    parts = []
    if hi is None or hi >= 0:
        parts += _nonneg_range(max(lo, 0) if lo is not None else 0, hi)
    if lo is None or lo < 0:
        k_lo = max(1, -hi) if hi is not None else 1
        k_hi = -lo if lo is not None else None
        parts += ["-" + p for p in _wrap(_nonneg_range(k_lo, k_hi))]
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else "(?:" + "|".join(parts) + ")"


def _wrap(parts):
    if not parts:
        return []
    return [parts[0] if len(parts) == 1 else "(?:" + "|".join(parts) + ")"]


_FRAC = r"(?:\.[0-9]+)?"
_ZERO_FRAC = r"(?:\.0+)?"
_NONZERO_FRAC = r"\.[0-9]*[1-9][0-9]*"


def number_range(lo, hi, lo_excl: bool, hi_excl: bool) -> str | None:
    """Regex for JSON numbers (no exponent) in the interval; bounds must be integral."""
    for b in (lo, hi):
        if b is not None and float(b) != int(b):
            raise UnsupportedSchemaError(f"number bound {b} is not an integer value")
    lo = None if lo is None else int(lo)
    hi = None if hi is None else int(hi)
    parts = []
    # value = +(k.f) >= 0
    if hi is None or hi > 0 or (hi == 0 and not hi_excl):
        kmin = max(lo, 0) if lo is not None else 0
        parts += _magnitudes(kmin, hi, lo_excl and lo is not None and lo >= 0, hi_excl)
    # value = -(k.f) < 0
    if lo is None or lo < 0:
        kmin = max(-hi, 0) if hi is not None else 0
        kmax = -lo if lo is not None else None
        neg = _magnitudes(kmin, kmax, hi_excl and hi is not None and hi <= 0, lo_excl, strictly_pos=True)
        parts += ["-" + p for p in _wrap(neg)]
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else "(?:" + "|".join(parts) + ")"


def _magnitudes(kmin, kmax, kmin_excl, kmax_excl, strictly_pos=False):
    """Alternatives for magnitudes m = k.f with kmin <= m <= kmax (exclusive flags)."""
    parts = []
    inner_lo = kmin + 1 if (kmin_excl or strictly_pos and kmin == 0) else kmin
    inner_hi = None if kmax is None else kmax - 1
    parts += [f"{p}{_FRAC}" for p in _wrap(_nonneg_range(inner_lo, inner_hi))]
    if inner_lo != kmin and (kmax is None or kmin < kmax):  # k == kmin needs a non-zero fraction
        parts.append(f"{kmin}{_NONZERO_FRAC}")
    if kmax is not None and not kmax_excl and kmax > kmin:
        parts.append(f"{kmax}{_ZERO_FRAC}")
    if kmax is not None and kmax == kmin and not kmax_excl and not kmin_excl and not (strictly_pos and kmin == 0):
        parts.append(f"{kmax}{_ZERO_FRAC}")
    return parts


def string_not_in(names) -> str:
    """Regex for a JSON string (with quotes) whose value is none of `names` (canonical text)."""
    trie: dict = {}
    for name in names:
        node = trie
        for ch in name:
            node = node.setdefault(ch, {})
        node[None] = {}

    def walk(node) -> str:
        kids = [c for c in node if c is not None]
        alts = [] if None in node else [""]
        if kids:
            other = ranges_to_json_regex(_complement([(ord(c), ord(c)) for c in kids]))
        else:
            other = STRING_CHAR
        alts.append(f"{other}{STRING_CHAR}*")
        alts += [json_char(c) + walk(node[c]) for c in kids]
        nonempty = [a for a in alts if a]
        body = "(?:" + "|".join(nonempty) + ")"
        return f"{body}?" if "" in alts else body

    return f'"{walk(trie)}"' if trie else STRING


_ASCII_CLASSES = {"d": "0-9", "w": "0-9A-Za-z_", "s": " \\t\\n\\r\\f\\v"}


def ascii_shorthands(regex: str) -> str:
    """Rewrite `\\d`, `\\w`, `\\s` (and `\\D`, `\\W`, `\\S` outside brackets) as ASCII classes.

    The token index's regex engine reads them as Unicode classes (so `\\d` accepts, e.g.,
    Garay digits); users and Python's `re` on ASCII text mean `[0-9]`.
    """
    out, i, depth = [], 0, 0  # depth: inside a bracket expression
    while i < len(regex):
        ch = regex[i]
        if ch == "\\" and i + 1 < len(regex):
            nxt = regex[i + 1]
            lower = nxt.lower()
            if lower in _ASCII_CLASSES and (depth == 0 or nxt.islower()):
                body = _ASCII_CLASSES[lower]
                if depth:
                    out.append(body)
                else:
                    out.append(f"[{'^' if nxt.isupper() else ''}{body}]")
            else:
                out.append(regex[i:i + 2])
            i += 2
            continue
        if ch == "[" and depth == 0:
            depth = 1
            out.append(ch)
            i += 1
            if i < len(regex) and regex[i] == "^":
                out.append("^")
                i += 1
            if i < len(regex) and regex[i] == "]":  # a literal ] first in the class
                out.append("]")
                i += 1
            continue
        if ch == "]" and depth:
            depth = 0
        out.append(ch)
        i += 1
    return "".join(out)
