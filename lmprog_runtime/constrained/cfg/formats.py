"""`format` values checked as whole-string patterns (ECMA syntax, regex_parse.py).

Unknown formats are annotations (accepted as any string). The ones below are enforced
unless the schema's dialect makes `format` an annotation (`format_asserted`: `$schema` draft
2020-12 / 2019-09, whose default format-annotation vocabulary the spec prescribes).
"""
from __future__ import annotations

import re

# RFC 3339 full-date: the days of each month, February's 29th in leap years only (every
# fourth year but the centuries not divisible by 400)
_DATE = (r"(\d{4}-(0[13578]|1[02])-(0[1-9]|[12]\d|3[01])|\d{4}-(0[469]|11)-(0[1-9]|[12]\d|30)"
         r"|\d{4}-02-(0[1-9]|1\d|2[0-8])|(\d\d(0[48]|[2468][048]|[13579][26])|([02468][048]|[13579][26])00)-02-29)")
# RFC 3339 full-time; a leap second (`:60`) only where it is one: at 23:59 UTC, written with a
# zero offset (one written with another offset, `15:59:60-08:00`, is refused: which local
# time each offset allows would take ~1400 alternatives of the pattern)
_TIME = (r"(([01]\d|2[0-3]):[0-5]\d:[0-5]\d(\.\d+)?([Zz]|[+-]([01]\d|2[0-3]):[0-5]\d)"
         r"|23:59:60(\.\d+)?([Zz]|[+-]00:00))")
_OCTET = r"(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
_IPV4 = rf"{_OCTET}(\.{_OCTET}){{3}}"
_H = r"[0-9A-Fa-f]{1,4}"
_IPV6 = "|".join([
    rf"({_H}:){{7}}{_H}",
    rf"({_H}:){{1,7}}:",
    rf"({_H}:){{1,6}}:{_H}",
    rf"({_H}:){{1,5}}(:{_H}){{1,2}}",
    rf"({_H}:){{1,4}}(:{_H}){{1,3}}",
    rf"({_H}:){{1,3}}(:{_H}){{1,4}}",
    rf"({_H}:){{1,2}}(:{_H}){{1,5}}",
    rf"{_H}:(:{_H}){{1,6}}",
    rf":((:{_H}){{1,7}}|:)",
    rf"({_H}:){{6}}{_IPV4}",  # (the last 32 bits as a dotted IPv4 address, `::` anywhere before it)
    rf"::({_H}:){{0,5}}{_IPV4}",
    *(rf"({_H}:){{0,{k}}}{_H}::({_H}:){{0,{4 - k}}}{_IPV4}" for k in range(5)),
])
# a hostname's label: 1 to 63 letters, digits, hyphens, not starting or ending with a hyphen;
# not an IDNA A-label (`xn--`, any case: whether its Punycode spells a valid U-label, RFC
# 5891, is not checked, so none is offered)
_LABEL = ("([A-Za-z0-9]([A-Za-z0-9-]?[A-Za-z0-9])?"
          "|[A-WYZa-wyz0-9][A-Za-z0-9-]{2,61}[A-Za-z0-9]"
          "|[xX][A-MO-Za-mo-z0-9-][A-Za-z0-9-]{1,60}[A-Za-z0-9]"
          "|[xX][nN][A-Za-z0-9]([A-Za-z0-9-]{0,59}[A-Za-z0-9])?"
          "|[xX][nN]-[A-Za-z0-9]([A-Za-z0-9-]{0,58}[A-Za-z0-9])?)")
HOSTNAME_CHARS = 253  # a hostname's length at most (255 octets on the wire, RFC 1123 / 2181)
# RFC 3986 (ASCII only: a character outside it is written %XX): scheme ":" hier-part
# ["?" query] ["#" fragment], the authority's host an IP literal or a reg-name (which spells
# every IPv4 address too)
_PCT = r"%[0-9A-Fa-f]{2}"
_SUB = r"!$&'()*+,;="
_PCHAR = rf"([A-Za-z0-9\-._~{_SUB}:@]|{_PCT})"
_SEGMENT_NZ = rf"{_PCHAR}+(/{_PCHAR}*)*"
_HOST = (rf"(\[(({_IPV6})|v[0-9A-Fa-f]+\.[A-Za-z0-9\-._~{_SUB}:]+)\]"
         rf"|([A-Za-z0-9\-._~{_SUB}]|{_PCT})*)")
_AUTHORITY = rf"(([A-Za-z0-9\-._~{_SUB}:]|{_PCT})*@)?{_HOST}(:[0-9]*)?"
_URI = (rf"[A-Za-z][A-Za-z0-9+.\-]*:(//{_AUTHORITY}(/{_PCHAR}*)*|/({_SEGMENT_NZ})?|{_SEGMENT_NZ}|)"
        rf"(\?({_PCHAR}|[/?])*)?(#({_PCHAR}|[/?])*)?")

# ECMA-262's \s spelled out (White_Space and line terminators), so that Python's `re` reads
# the patterns as the grammar does (`format_checks`)
_WS = "\t\n\x0b\x0c\r \u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000\ufeff"

FORMATS = {
    "date": _DATE,
    "time": _TIME,
    "date-time": rf"{_DATE}[Tt]{_TIME}",
    "email": rf"[^@{_WS}\".]+(\.[^@{_WS}\".]+)*@[^@{_WS}\"]+",  # (the local part's dots single, inside it)
    "uuid": r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}",
    "ipv4": _IPV4,
    "ipv6": _IPV6,
    "uri": _URI,
    "hostname": rf"{_LABEL}(\.{_LABEL})*",
}

# dialects whose default vocabularies make `format` an annotation (format-annotation)
_ANNOTATION_DIALECTS = frozenset(("https://json-schema.org/draft/2020-12/schema",
                                  "https://json-schema.org/draft/2019-09/schema"))
_ASSERTION_VOCABS = ("https://json-schema.org/draft/2020-12/vocab/format-assertion",
                     "https://json-schema.org/draft/2019-09/vocab/format-assertion")


# the formats of ours each older dialect defines (later drafts added the others: an unknown
# format is an annotation); 2019-09 on and without `$schema`: all of them
_DRAFT4_FORMATS = frozenset(("date-time", "email", "hostname", "ipv4", "ipv6", "uri"))
_DIALECT_FORMATS = {f"{scheme}://json-schema.org/draft-{n}/schema": formats for scheme in ("http", "https")
                    for n, formats in (("03", _DRAFT4_FORMATS), ("04", _DRAFT4_FORMATS), ("06", _DRAFT4_FORMATS),
                                       ("07", _DRAFT4_FORMATS | {"date", "time"}))}


def dialect_formats(root) -> frozenset:
    """The formats of FORMATS that `root`'s dialect defines (asserted where format_asserted)."""
    dialect = root.get("$schema") if isinstance(root, dict) else None
    got = _DIALECT_FORMATS.get(dialect.rstrip("#")) if isinstance(dialect, str) else None
    return frozenset(FORMATS) if got is None else got


def format_asserted(root, registry) -> bool:
    """Whether `format` is an assertion for the schema `root`: an annotation when `$schema`
    names draft 2020-12 or 2019-09 (their default format-annotation vocabulary) or a
    metaschema whose `$vocabulary` lacks format-assertion; asserted otherwise (no `$schema`,
    draft-07 and older, which allow it), so a generated date is a date."""
    dialect = root.get("$schema") if isinstance(root, dict) else None
    if not isinstance(dialect, str):
        return True
    dialect = dialect.rstrip("#")
    if dialect in _ANNOTATION_DIALECTS:
        return False
    meta = registry.get(dialect)
    vocab = meta.get("$vocabulary") if isinstance(meta, dict) else None
    if isinstance(vocab, dict):
        return any(v in vocab for v in _ASSERTION_VOCABS)
    return True


def format_checks(root, registry) -> dict:
    """format -> a test of a value (any non-string passes), for the formats `root`'s grammar asserts (none where
    format is an annotation): the residual's validator asserts the same ones inside its
    checks (`not`, `anyOf`, ... read the value whole), with the same patterns (Python's `re`,
    ASCII classes as ECMA-262's) and hostname length."""
    if not format_asserted(root, registry):
        return {}
    out = {}
    for name in dialect_formats(root):
        match = re.compile(FORMATS[name], re.ASCII).fullmatch
        most = HOSTNAME_CHARS if name == "hostname" else None
        out[name] = (lambda m, most: lambda v: not isinstance(v, str) or (
            (most is None or len(v) <= most) and m(v) is not None))(match, most)
    return out
