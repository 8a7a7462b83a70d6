"""Parser: ECMA-262 pattern text -> RegexPool term (regex.py).

`compile_pattern(pool, text, search=True)` gives JSON Schema's `pattern` semantics (an
unanchored search: `.*` around each top-level alternative unless it starts with `^` /
ends with `$`); `search=False` is a whole-text match (the `regex` constraint kind).
"""
from __future__ import annotations

from typing import Optional

from lmprog_runtime.constrained.cfg.regex import (_DIGIT, _LINE_TERMINATORS, _SPACE, _WORD, MAX_CP, RegexError,
                                                  RegexPool, negate, normalize, unicode_property)

_ESCAPES = {"n": 0x0A, "r": 0x0D, "t": 0x09, "f": 0x0C, "v": 0x0B, "0": 0x00, "a": 0x07, "e": 0x1B}
_CLASS_ESCAPES = {"d": _DIGIT, "w": _WORD, "s": _SPACE}
MAX_REPEAT = 1_000_000


def compile_pattern(pool: RegexPool, text: str, search: bool = True) -> int:
    parser = _Parser(pool, text)
    branches = parser.top()
    anything = pool.any_star()
    out = []
    for starts, ends, term in branches:
        if search and not starts:
            term = pool.cat(anything, term)
        if search and not ends:
            term = pool.cat(term, anything)
        out.append(term)
    return pool.alt(out)


class _Parser:
    def __init__(self, pool: RegexPool, text: str):
        self.pool, self.s, self.i = pool, text, 0

    def error(self, what: str) -> RegexError:
        return RegexError(f"pattern {self.s!r}: {what} (at offset {self.i})")

    def peek(self) -> Optional[str]:
        return self.s[self.i] if self.i < len(self.s) else None

    def take(self) -> str:
        if self.i >= len(self.s):
            raise self.error("unexpected end")
        ch = self.s[self.i]
        self.i += 1
        return ch

    # ------------------------------------------------------------ structure
    def top(self) -> list[tuple[bool, bool, int]]:
        """Top-level alternatives as (anchored at start, anchored at end, term)."""
        out = []
        while True:
            starts = self.peek() == "^"
            if starts:
                self.i += 1
            term, ends = self.sequence(top=True)
            out.append((starts, ends, term))
            if self.peek() is None:
                return out
            self.take()  # "|"

    def alternation(self) -> int:
        items = [self.sequence()[0]]
        while self.peek() == "|":
            self.i += 1
            items.append(self.sequence()[0])
        return self.pool.alt(items)

    def sequence(self, top: bool = False) -> tuple[int, bool]:
        items, ends = [], False
        while self.peek() not in (None, "|", ")"):
            if self.peek() == "$":
                self.i += 1
                if top and self.peek() in (None, "|"):
                    ends = True
                    break
                raise self.error("`$` is supported only at the end of a top-level alternative")
            if self.peek() == "^":
                raise self.error("`^` is supported only at the start of a top-level alternative")
            items.append(self.quantified(self.atom()))
        if self.peek() == ")" and top:
            raise self.error("unbalanced `)`")
        return self.pool.seq(items), ends

    def quantified(self, term: int) -> int:
        while True:
            ch = self.peek()
            if ch == "*":
                lo, hi = 0, None
            elif ch == "+":
                lo, hi = 1, None
            elif ch == "?":
                lo, hi = 0, 1
            elif ch == "{" and self._counted() is not None:
                lo, hi = self._counted()
                self.i = self._count_end
            else:
                return term
            if ch != "{":
                self.i += 1
            if self.peek() in ("?", "+"):  # lazy / possessive: the same language
                self.i += 1
            term = self.pool.repeat(term, lo, hi)

    def _counted(self) -> Optional[tuple[int, Optional[int]]]:
        j = self.s.find("}", self.i)
        if j < 0:
            return None
        body = self.s[self.i + 1:j]
        lo_s, comma, hi_s = body.partition(",")
        if not lo_s.isdigit() or (hi_s and not hi_s.isdigit()):
            return None  # a literal "{" (Annex B)
        lo = int(lo_s)
        hi = int(hi_s) if hi_s else (None if comma else lo)
        if lo > MAX_REPEAT or (hi is not None and hi > MAX_REPEAT):
            raise self.error(f"repetition bound over {MAX_REPEAT}")
        if hi is not None and hi < lo:
            raise self.error("repetition {m,n} with n < m")
        self._count_end = j + 1
        return lo, hi

    def atom(self) -> int:
        ch = self.take()
        pool = self.pool
        if ch == "(":
            return self.group()
        if ch == "[":
            return pool.chars(self.char_class())
        if ch == ".":
            return pool.chars(negate(_LINE_TERMINATORS))
        if ch == "\\":
            return pool.chars(self.escape(in_class=False))
        if ch in "*+?":
            raise self.error(f"nothing to repeat before `{ch}`")
        return pool.chars(((ord(ch), ord(ch)),))

    def group(self) -> int:
        if self.s.startswith("?", self.i):
            nxt = self.s[self.i + 1:self.i + 3]
            if nxt[:1] in ("=", "!") or nxt in ("<=", "<!"):
                raise self.error("lookaround assertions are not supported")
            if nxt[:1] == ":":
                self.i += 2
            elif nxt[:1] in ("<", "P"):
                end = self.s.find(">", self.i)
                if end < 0:
                    raise self.error("unterminated group name")
                self.i = end + 1
            else:
                raise self.error(f"unsupported group `(?{nxt[:1]}`")
        term = self.alternation()
        if self.peek() != ")":
            raise self.error("missing `)`")
        self.i += 1
        return term

    # ------------------------------------------------------------ classes and escapes
    def char_class(self) -> tuple:
        negated = self.peek() == "^"
        if negated:
            self.i += 1
        ranges: list[tuple[int, int]] = []
        first = True
        while True:
            ch = self.take()
            if ch == "]" and not first:
                break
            first = False
            lo_set = self.escape(in_class=True) if ch == "\\" else ((ord(ch), ord(ch)),)
            if self.peek() == "-" and self.s[self.i + 1:self.i + 2] not in ("]", "") and len(lo_set) == 1 \
                    and lo_set[0][0] == lo_set[0][1]:
                self.i += 1
                ch2 = self.take()
                hi_set = self.escape(in_class=True) if ch2 == "\\" else ((ord(ch2), ord(ch2)),)
                if len(hi_set) != 1 or hi_set[0][0] != hi_set[0][1]:
                    raise self.error("a class escape cannot end a range")
                if hi_set[0][0] < lo_set[0][0]:
                    raise self.error("character range out of order")
                ranges.append((lo_set[0][0], hi_set[0][0]))
            else:
                ranges.extend(lo_set)
        return negate(ranges) if negated else normalize(ranges)

    def escape(self, in_class: bool) -> tuple:
        ch = self.take()
        if ch in _CLASS_ESCAPES:
            return _CLASS_ESCAPES[ch]
        if ch.lower() in _CLASS_ESCAPES:
            return negate(_CLASS_ESCAPES[ch.lower()])
        if ch in ("p", "P"):
            if self.peek() != "{":
                raise self.error("\\p needs {Property}")
            end = self.s.find("}", self.i)
            ranges = unicode_property(self.s[self.i + 1:end])
            self.i = end + 1
            return negate(ranges) if ch == "P" else ranges
        if ch in _ESCAPES and not (ch == "0" and (self.peek() or "").isdigit()):
            return ((_ESCAPES[ch], _ESCAPES[ch]),)
        if ch == "b" and in_class:
            return ((8, 8),)
        if ch in "bB":
            raise self.error("word boundaries (\\b, \\B) are not supported")
        if ch.isdigit():
            raise self.error("backreferences are not supported")
        if ch in ("x", "u"):
            return self._hex_escape(ch)
        if ch == "c" and (self.peek() or "").isalpha():
            cp = ord(self.take()) % 32
            return ((cp, cp),)
        if ch == "k":
            raise self.error("named backreferences are not supported")
        return ((ord(ch), ord(ch)),)  # an identity escape: \. \- \/ ...

    def _hex_escape(self, ch: str) -> tuple:
        if ch == "u" and self.peek() == "{":
            end = self.s.find("}", self.i)
            digits, self.i = self.s[self.i + 1:end], end + 1
        else:
            n = 2 if ch == "x" else 4
            digits = self.s[self.i:self.i + n]
            if len(digits) != n or any(c not in "0123456789abcdefABCDEF" for c in digits):
                return ((ord(ch), ord(ch)),)
            self.i += n
        cp = int(digits, 16)
        if cp > MAX_CP:
            raise self.error("code point out of range")
        return ((cp, cp),)
