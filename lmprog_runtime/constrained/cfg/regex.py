"""Regular expressions as lazily-derived automata (Brzozowski derivatives over code points).

A pattern is parsed (ECMA-262 dialect, the one JSON Schema names; Python's `re` spellings
of the same constructs read the same) into interned terms of a `RegexPool`; a DFA state *is*
a term id, and `pool.step(state, cp)` derives it by one code point, memoized. Nothing is
built up front: `x{1,4096}` is one term whose derivatives count down (`x{0,4095}`, ...), so
compile cost is independent of repetition bounds, and only states a generation actually
visits are ever created. `pool.nullable(state)` says whether the text so far matches;
state `pool.NONE` is dead.

Refused with RegexError (naming the construct): lookarounds, backreferences, word
boundaries, anchors other than at the ends of a top-level alternative.
"""
from __future__ import annotations

import bisect
import threading
import unicodedata
from typing import Optional

MAX_CP = 0x10FFFF
NEVER = 1 << 30  # min_chars of the dead state (no text: more than any length bound)
MAX_DERIVATIONS = 1 << 20  # (state, code point) steps memoized per pool (emptied past it: every code point is one)
_LINE_TERMINATORS = ((0x0A, 0x0A), (0x0D, 0x0D), (0x2028, 0x2029))
_DIGIT = ((0x30, 0x39),)
_WORD = ((0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A))
_SPACE = ((0x09, 0x0D), (0x20, 0x20), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A),
          (0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000), (0xFEFF, 0xFEFF))
_PROPERTY_ALIASES = {"Letter": "L", "Lowercase_Letter": "Ll", "Uppercase_Letter": "Lu", "Number": "N",
                     "Decimal_Number": "Nd", "digit": "Nd", "Punctuation": "P", "Symbol": "S",
                     "Mark": "M", "Separator": "Z", "Other": "C", "Alphabetic": "L"}
_property_cache: dict[str, tuple] = {}


class RegexError(ValueError):
    """A pattern the engine cannot compile (the message names the construct)."""


def normalize(ranges) -> tuple:
    """Sorted, merged, non-overlapping (lo, hi) code-point ranges."""
    out: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return tuple((lo, hi) for lo, hi in out)


def negate(ranges) -> tuple:
    out, nxt = [], 0
    for lo, hi in normalize(ranges):
        if lo > nxt:
            out.append((nxt, lo - 1))
        nxt = hi + 1
    if nxt <= MAX_CP:
        out.append((nxt, MAX_CP))
    return tuple(out)


def in_ranges(ranges, cp: int) -> bool:
    for lo, hi in ranges:
        if cp < lo:
            return False
        if cp <= hi:
            return True
    return False


def unicode_property(name: str) -> tuple:
    """Code-point ranges of a general category (`L`, `Lu`, `Nd`, ...), built once per name."""
    cat = _PROPERTY_ALIASES.get(name.split("=")[-1], name.split("=")[-1])
    if cat in _property_cache:
        return _property_cache[cat]
    if not cat or not cat[0].isupper() or len(cat) > 2:
        raise RegexError(f"unsupported Unicode property \\p{{{name}}}")
    ranges, start = [], None
    for cp in range(MAX_CP + 2):
        hit = cp <= MAX_CP and unicodedata.category(chr(cp)).startswith(cat)
        if hit and start is None:
            start = cp
        elif not hit and start is not None:
            ranges.append((start, cp - 1))
            start = None
    if not ranges:
        raise RegexError(f"unknown Unicode property \\p{{{name}}}")
    _property_cache[cat] = tuple(ranges)
    return _property_cache[cat]


class RegexPool:
    """Interned regex terms; ids are states. Thread-safe for concurrent matchers."""

    NONE, EPS = 0, 1

    def __init__(self, max_terms: int = 2_000_000):
        self._terms: list[tuple] = [("0",), ("e",)]
        self._ids: dict[tuple, int] = {("0",): 0, ("e",): 1}
        self._null: dict[int, bool] = {0: False, 1: True}
        self._deriv: dict[tuple[int, int], int] = {}
        self._first: dict[int, tuple] = {}
        self._first_ends: dict = {}  # state (or state, characters left) -> its first set's range starts and ends (can_start_in)
        self._min: dict[int, int] = {}  # state -> min_chars
        self._most: dict[int, int] = {}  # state -> _most_after
        self._within: dict[tuple[int, int], tuple] = {}  # (state, characters left) -> first_within
        self._lock = threading.Lock()
        self.max_terms = max_terms
        self._n_charsets = 0
        # Σ* (any text): absorbs what it is joined with, so that a search pattern's states
        # after its match are one state, whatever came after the match (`alt`, `cat`)
        self._any = self._intern(("*", self._intern(("c", ((0, MAX_CP),)))))

    def _intern(self, key: tuple) -> int:
        got = self._ids.get(key)
        if got is not None:
            return got
        with self._lock:
            got = self._ids.get(key)
            if got is None:
                if len(self._terms) >= self.max_terms:
                    raise RegexError(f"the pattern's automaton grew past {self.max_terms} states")
                got = len(self._terms)
                self._terms.append(key)
                self._n_charsets += key[0] == "c"
                self._ids[key] = got
        return got

    # ------------------------------------------------------------ smart constructors
    def chars(self, ranges) -> int:
        ranges = normalize(ranges)
        return self._intern(("c", ranges)) if ranges else self.NONE

    def cat(self, a: int, b: int) -> int:
        if a == self.NONE or b == self.NONE:
            return self.NONE
        if a == self.EPS:
            return b
        if b == self.EPS:
            return a
        if b == self._any and self.nullable(a):  # (a Σ*, a nullable: every text)
            return b
        ta = self._terms[a]
        if ta[0] == ".":  # right-nested: (x y) b -> x (y b)
            return self.cat(ta[1], self.cat(ta[2], b))
        return self._intern((".", a, b))

    def seq(self, items) -> int:
        out = self.EPS
        for t in reversed(list(items)):
            out = self.cat(t, out)
        return out

    def alt(self, items) -> int:
        flat: set[int] = set()
        for t in items:
            term = self._terms[t]
            if term[0] == "|":
                flat.update(term[1])
            elif t != self.NONE:
                flat.add(t)
        if not flat:
            return self.NONE
        if self._any in flat:
            return self._any
        if len(flat) == 1:
            return next(iter(flat))
        return self._intern(("|", tuple(sorted(flat))))

    def star(self, a: int) -> int:
        if a in (self.NONE, self.EPS):
            return self.EPS
        if self._terms[a][0] == "*":
            return a
        return self._intern(("*", a))

    def complement(self, a: int) -> int:
        """The texts `a` does not match (`not {pattern: P}`: the strings P's search finds
        nothing in). Σ* and nothing are each other's complement, so a search pattern's
        complement is dead right after its match (its state there is Σ*)."""
        if a == self.NONE:
            return self._any
        if a == self._any:
            return self.NONE
        term = self._terms[a]
        if term[0] == "~":
            return term[1]
        return self._intern(("~", a))

    def repeat(self, a: int, lo: int, hi: Optional[int]) -> int:
        if hi is not None and hi < lo:
            return self.NONE
        if hi == 0 or a == self.EPS:
            return self.EPS
        if a == self.NONE:
            return self.EPS if lo == 0 else self.NONE
        if lo == 0 and hi is None:
            return self.star(a)
        if lo == 1 and hi == 1:
            return a
        return self._intern(("r", a, lo, hi))

    # ------------------------------------------------------------ semantics
    def nullable(self, t: int) -> bool:
        got = self._null.get(t)
        if got is None:
            term = self._terms[t]
            k = term[0]
            if k == "c":
                got = False
            elif k == ".":
                got = self.nullable(term[1]) and self.nullable(term[2])
            elif k == "|":
                got = any(self.nullable(x) for x in term[1])
            elif k == "*":
                got = True
            elif k == "~":
                got = not self.nullable(term[1])
            else:  # repeat
                got = term[2] == 0 or self.nullable(term[1])
            self._null[t] = got
        return got

    def min_chars(self, t: int) -> int:
        """A lower bound on the characters of the texts state `t` matches: exact but under a
        complement (which counts 1 where the complemented term matches the empty text, else
        0); NONE counts NEVER, more than any length bound. A string under maxLength is
        refused at the character after which a pattern needs more characters than are
        left (strings.py `_fits`)."""
        got = self._min.get(t)
        if got is None:
            term = self._terms[t]
            k = term[0]
            if k == "0":
                got = NEVER
            elif k in ("e", "*"):
                got = 0
            elif k == "c":
                got = 1
            elif k == ".":  # (right-nested: the chain walked in a loop, not a recursion per item)
                got, x = 0, t
                while self._terms[x][0] == ".":
                    got += self.min_chars(self._terms[x][1])
                    x = self._terms[x][2]
                got = min(got + self.min_chars(x), NEVER)
            elif k == "|":
                got = min(self.min_chars(x) for x in term[1])
            elif k == "~":
                got = 1 if self.nullable(term[1]) else 0
            else:  # repeat
                got = min(term[2] * self.min_chars(term[1]), NEVER)
            self._min[t] = got
        return got

    def most_needed(self, t: int) -> int:
        """An upper bound on `min_chars` of `t` and of every live state reachable from it,
        so that from that many characters left a string's patterns no longer bind (mask.py
        keys its string bodies' counts up to it past the longest token)."""
        return max(min(self.min_chars(t), NEVER - 1), self._most_after(t))

    def _most_after(self, t: int) -> int:
        """An upper bound on `min_chars` of the states one character or more past `t`: a
        concatenation's are one of its items' before the items after it, a repetition's
        one of its item's before the rest of the count, a star's one of its item's before
        the star."""
        got = self._most.get(t)
        if got is None:
            term = self._terms[t]
            k = term[0]
            if k in ("0", "e", "c"):
                got = 0
            elif k == ".":
                items, x = [], t
                while self._terms[x][0] == ".":
                    items.append(self._terms[x][1])
                    x = self._terms[x][2]
                items.append(x)
                got, tail = 0, 0  # (from the last item back: the items' min_chars after each)
                for item in reversed(items):
                    got = max(got, self._most_after(item) + tail)
                    tail = min(tail + self.min_chars(item), NEVER)
                got = min(got, NEVER - 1)
            elif k == "|":
                got = max(self._most_after(x) for x in term[1])
            elif k == "*":
                got = self._most_after(term[1])
            elif k == "~":
                got = 1
            else:  # repeat
                got = min(self._most_after(term[1]) + max(term[2] - 1, 0) * self.min_chars(term[1]), NEVER - 1)
            self._most[t] = got
        return got

    def first_within(self, t: int, left: int) -> tuple:
        """Code-point ranges after which state `t` can still match within `left` more
        characters (min_chars of the derivative at most `left`): `first` where `left` is
        past most_needed; a superset under a complement (each of its derivatives needs at
        most one character: every code point where `left` is 0). A string under maxLength
        refuses the first byte of a character none of which leaves its patterns room
        (strings.py `_pats_can`)."""
        if left >= self.most_needed(t):
            return self.first(t)
        return () if left < 0 else self._first_of(t, left)

    def step(self, t: int, cp: int) -> int:
        """The state after reading code point `cp` from state `t` (NONE: dead)."""
        key = (t, cp)
        got = self._deriv.get(key)
        if got is None:
            got = self._derive(t, cp)
            if len(self._deriv) >= MAX_DERIVATIONS:  # (a memo: the terms themselves stay interned)
                self._deriv.clear()
            self._deriv[key] = got
        return got

    def _derive(self, t: int, cp: int) -> int:
        term = self._terms[t]
        k = term[0]
        if k in ("0", "e"):
            return self.NONE
        if k == "c":
            return self.EPS if in_ranges(term[1], cp) else self.NONE
        if k == ".":
            head = self.cat(self.step(term[1], cp), term[2])
            return self.alt((head, self.step(term[2], cp))) if self.nullable(term[1]) else head
        if k == "|":
            return self.alt(self.step(x, cp) for x in term[1])
        if k == "*":
            return self.cat(self.step(term[1], cp), t)
        if k == "~":
            return self.complement(self.step(term[1], cp))
        a, lo, hi = term[1], term[2], term[3]
        rest = self.repeat(a, max(lo - 1, 0), None if hi is None else hi - 1)
        return self.cat(self.step(a, cp), rest)

    def first(self, t: int) -> tuple:
        """Code-point ranges that can start a match from state `t` (d(t, cp) != NONE); for a
        complement, every code point (a superset: its derivative is dead only where the
        pattern's is Σ*, which a range of code points does not tell)."""
        return self._first_of(t, None)

    def _first_of(self, t: int, left: Optional[int]) -> tuple:
        """`first` (left None) or `first_within(t, left)`, by the term's structure: a
        concatenation's head within what its tail leaves (and the tail where the head may
        be empty), a repetition's item within what the rest of its count leaves."""
        memo, key = (self._first, t) if left is None else (self._within, (t, left))
        got = memo.get(key)
        if got is None:
            term = self._terms[t]
            k = term[0]
            if k in ("0", "e"):
                got = ()
            elif k == "c":
                got = term[1]
            elif k == ".":
                got = self._first_part(term[1], left, self.min_chars(term[2]))
                if self.nullable(term[1]):
                    got = normalize(got + self._first_part(term[2], left, 0))
            elif k == "|":
                got = normalize(r for x in term[1] for r in self._first_part(x, left, 0))
            elif k == "~":
                got = ((0, MAX_CP),)
            elif k == "*":
                got = self._first_part(term[1], left, 0)
            else:  # repeat
                got = self._first_part(term[1], left, max(term[2] - 1, 0) * self.min_chars(term[1]))
            if left is not None and len(memo) >= MAX_DERIVATIONS:
                memo.clear()
            memo[key] = got
        return got

    def _first_part(self, t: int, left: Optional[int], after: int) -> tuple:
        """`_first_of` of part `t` of a term, `after` more characters needed past it."""
        return self.first(t) if left is None else self.first_within(t, left - after)

    def can_start_in(self, t: int, lo: int, hi: int, left: Optional[int] = None) -> bool:
        """Some code point in [lo, hi] keeps state `t` alive (and, `left` characters left
        after it, able to match within them: `first_within`), by bisection: a Unicode
        property's first set has hundreds of ranges."""
        if left is not None and left >= self.most_needed(t):
            left = None  # (no pattern state past t needs more: every live character)
        key = t if left is None else (t, left)
        got = self._first_ends.get(key)
        if got is None:
            ranges = normalize(self.first(t) if left is None else self.first_within(t, left))
            if len(self._first_ends) >= MAX_DERIVATIONS:
                self._first_ends.clear()
            got = self._first_ends[key] = ([a for a, _ in ranges], [b for _, b in ranges])
        k = bisect.bisect_left(got[1], lo)  # (the first range ending at lo or past it)
        return k < len(got[0]) and got[0][k] <= hi

    def accepts(self, t: int, text: str) -> bool:
        for ch in text:
            t = self.step(t, ord(ch))
            if t == self.NONE:
                return False
        return self.nullable(t)

    def n_charsets(self) -> int:
        return self._n_charsets

    def charset_bounds(self) -> list[int]:
        """Sorted code points where some character set of the pool starts or stops matching."""
        out = set()
        for term in list(self._terms):
            if term[0] == "c":
                for lo, hi in term[1]:
                    out.add(lo)
                    out.add(hi + 1)
        return sorted(out)

    def any_star(self) -> int:
        return self._any
