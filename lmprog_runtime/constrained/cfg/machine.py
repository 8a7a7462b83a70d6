"""The pushdown matcher of a compiled value grammar, one byte at a time.

A parse state is a tuple of stacks (one per live alternative of an anyOf/oneOf: a
GLR-style set, deduplicated). A stack is a cons list `(frame, rest)`, frames are tuples, so
states are immutable, hashable and shared: rollback is keeping the old state, and the
token-trie walk branches without copying. Frames (first field = kind):

    ("V", node, ws)                            a value of `node` may start; ws: whitespace regex state
    ("O", node, phase, seen, key, ws)          object; phase 0 `{` 1 key 2 value 3 `,` 4 in value
    ("A", node, phase, count, seen, ws)        array; phase 0 `[` 2 item 3 `,` 4 in item
    ("S", node, count, utf, esc, hs, pats, text)  string body: char count, UTF-8 (need, cp, lo, hi, raw) / escape
                                               decoder states, pending high surrogate, regex
                                               states, text (kept for keys and enums only)
    ("N", node, text, d)                       number text and its JSON-number DFA state
    ("L", literal, i)                          true / false / null, i bytes read
    ("C", node, start)                         residual check of the value starting at byte `start`
    ("U", start)                               capture of a uniqueItems array item
    ("R", term, utf)                           a whole-output regex (the `regex` kind)
    ("D", done)                                bottom; done = 1 once the root value is complete

`ctx(start, end)` returns output bytes [start, end) (committed output + the bytes being
tried), read only when a captured value completes.
"""
from __future__ import annotations

import bisect
from typing import Callable, Optional

from lmprog_runtime.constrained.cfg.nodes import Node
from lmprog_runtime.constrained.cfg.residual import Residual, canonical

WS = frozenset(b" \t\n\r")
DIGITS = frozenset(b"0123456789")
# JSON number DFA: 0 start, 1 '-', 2 '0', 3 int, 4 '.', 5 frac, 6 'e', 7 exp sign, 8 exp
_NUM: list[dict[int, int]] = [{} for _ in range(9)]
for _d in DIGITS:
    _NUM[0][_d] = _NUM[1][_d] = 2 if _d == 0x30 else 3
    _NUM[3][_d] = 3
    _NUM[4][_d] = _NUM[5][_d] = 5
    _NUM[6][_d] = _NUM[7][_d] = _NUM[8][_d] = 8
_NUM[0][0x2D] = 1
for _s in (2, 3):
    _NUM[_s][0x2E] = 4
for _s in (2, 3, 5):
    _NUM[_s][0x65] = _NUM[_s][0x45] = 6
_NUM[6][0x2B] = _NUM[6][0x2D] = 7
NUM_COMPLETE = frozenset((2, 3, 5, 8))
MAX_NUMBER_CHARS = 400
_ESC = {0x22: 0x22, 0x5C: 0x5C, 0x2F: 0x2F, 0x62: 8, 0x66: 12, 0x6E: 10, 0x72: 13, 0x74: 9}
_HEX = {b: int(chr(b), 16) for b in b"0123456789abcdefABCDEF"}

Ctx = Callable[[int, int], bytes]


def utf8_start(b: int):
    """Decoder state after a UTF-8 lead byte: (bytes still needed, code point so far, lo, hi
    bounds of the next byte); None for a byte that cannot start a character."""
    if 0xC2 <= b <= 0xDF:
        return (1, b & 0x1F, 0x80, 0xBF)
    if 0xE0 <= b <= 0xEF:
        return (2, b & 0x0F, 0xA0 if b == 0xE0 else 0x80, 0x9F if b == 0xED else 0xBF)
    if 0xF0 <= b <= 0xF4:
        return (3, b & 0x07, 0x90 if b == 0xF0 else 0x80, 0x8F if b == 0xF4 else 0xBF)
    return None


_UTF8_FLOOR = (0, 0x80, 0x800, 0x10000)
_VALUE_START = frozenset(b'"{[-0123456789tfn')
_FOLLOW = {"O": WS | frozenset(b",}"), "A": WS | frozenset(b",]"), "D": frozenset()}
_OBJ = {0: WS | frozenset(b'"}'), 1: WS | frozenset(b":"), 2: WS | frozenset(b",}"), 3: WS | frozenset(b'"')}
_ARR = {0: WS | _VALUE_START | frozenset(b"]"), 2: WS | frozenset(b",]"), 3: WS | _VALUE_START}
_NUM_NEXT = [frozenset(d) for d in _NUM]


def _follow(rest) -> frozenset:
    """Bytes that may come right after a complete value on top of `rest` (a superset)."""
    while rest[0][0] in ("C", "U"):
        rest = rest[1]
    return _FOLLOW[rest[0][0]]


class Machine:
    def __init__(self, root: Optional[Node], pool, residual: Optional[Residual], child_of, ws0: int,
                 regex_term: Optional[int] = None):
        """ws0: the whitespace pattern's start state (a RegexPool term) between JSON tokens."""
        self.root, self.pool, self.residual, self.ws0 = root, pool, residual, ws0
        self._child_of = child_of  # (node, key) -> Node | None
        self.regex_term = regex_term

    def initial(self) -> tuple:
        if self.regex_term is not None:
            return (((("R", self.regex_term, 0)), None),)
        return ((("V", self.root, self.pool.EPS), (("D", 0), None)),)  # no whitespace before the root

    # ------------------------------------------------------------ driving
    def advance(self, state: tuple, b: int, pos: int, ctx: Ctx) -> tuple:
        out: list = []
        for st in state:
            out.extend(self.step(st, b, pos, ctx))
        return tuple(dict.fromkeys(out)) if len(out) > 1 else tuple(out)

    def accepting(self, state: tuple, pos: int, ctx: Ctx) -> bool:
        for st in state:
            top = st[0]
            if top[0] == "D" and top[1]:
                return True
            if top[0] == "R" and top[2] == 0 and self.pool.nullable(top[1]):
                return True
            if top[0] == "N" and top[3] in NUM_COMPLETE and top[1].number_ok(top[2]):
                if any(s[0] == ("D", 1) for s in self.finish(st[1], None, pos, ctx)):
                    return True
        return False

    def candidates(self, state: tuple):
        """A superset of the bytes `advance` may accept from `state` (frozenset), or None for
        "any": lets the trie walk skip subtrees without stepping into them."""
        out: set = set()
        for st in state:
            top = st[0]
            kind = top[0]
            if kind == "O":
                got = _OBJ.get(top[2], WS)
            elif kind == "A":
                got = _ARR.get(top[2], WS)
            elif kind == "V":
                got = _VALUE_START | WS
            elif kind == "L":
                got = (ord(top[1][top[2]]),)
            elif kind == "N":
                got = _NUM_NEXT[top[3]] | (_follow(st[1]) if top[3] in NUM_COMPLETE else frozenset())
            elif kind == "D":
                continue
            elif kind == "S" and top[1].enum is not None and not top[3] and not top[4]:
                got = _enum_first_bytes(top[1], top[7])
            else:
                return None
            out.update(got)
        return out

    def complete(self, state: tuple) -> bool:
        """No byte can follow: every alternative is done."""
        return bool(state) and all(st[0] == ("D", 1) or (st[0][0] == "R" and st[0][1] == self.pool.EPS)
                                   for st in state)

    def step(self, st, b: int, pos: int, ctx: Ctx) -> list:
        top, rest = st
        kind = top[0]
        if kind == "S":
            return self._string(top, rest, b, pos, ctx)
        if kind == "V":
            if b in WS:
                ws = self.pool.step(top[2], b)
                return [(("V", top[1], ws), rest)] if ws != self.pool.NONE else []
            if not self.pool.nullable(top[2]):
                return []
            return self.start_value(rest, top[1], b, pos, ctx)
        if kind == "O":
            return self._object(top, rest, b, pos, ctx)
        if kind == "A":
            return self._array(top, rest, b, pos, ctx)
        if kind == "N":
            return self._number(top, rest, b, pos, ctx)
        if kind == "L":
            lit, i = top[1], top[2]
            if b != ord(lit[i]):
                return []
            return self.finish(rest, None, pos + 1, ctx) if i + 1 == len(lit) else [(("L", lit, i + 1), rest)]
        if kind == "R":
            return self._regex(top, rest, b)
        return []  # D: nothing after the root value

    def start_value(self, rest, node: Node, b: int, pos: int, ctx: Ctx) -> list:
        if node.never:
            return []
        if node.residual is not None:
            rest = (("C", node, pos), rest)
        if node.alts is not None:
            out: list = []
            for alt in node.alts:
                out.extend(self.start_value(rest, alt, b, pos, ctx))
            return out
        types = node.types
        if b == 0x22:
            if "string" not in types or (node.enum is not None and not node.enum):
                return []
            text = "" if node.enum is not None else None
            return [(("S", node, 0, 0, 0, 0, node.patterns, text), rest)]
        if b == 0x7B:
            return [(("O", node, 0, frozenset(), None, self.ws0), rest)] if "object" in types else []
        if b == 0x5B:
            if "array" not in types:
                return []
            return [(("A", node, 0, 0, frozenset() if node.unique else None, self.ws0), rest)]
        if b in DIGITS or b == 0x2D:
            if not node.allows_number() or not node.number_prefix_ok(chr(b)):
                return []
            return [(("N", node, chr(b), _NUM[0][b]), rest)]
        for lit in node.literals:
            if b == ord(lit[0]):
                return [(("L", lit, 1), rest)]
        return []

    # ------------------------------------------------------------ completion
    def finish(self, rest, result, end: int, ctx: Ctx) -> list:
        """The value on top of `rest` just completed (its text ends at byte `end`)."""
        top = rest[0]
        kind = top[0]
        if kind == "D":
            return [(("D", 1), rest[1])]
        if kind == "C":
            if not self.residual.valid_text(ctx(top[2], end), top[1].residual):
                return []
            return self.finish(rest[1], result, end, ctx)
        if kind == "U":
            value = canonical(ctx(top[1], end))
            return self.finish(rest[1], value, end, ctx)
        if kind == "A":
            seen = top[4]
            if seen is not None:
                if result in seen:
                    return []
                seen = seen | {result}
            return [(("A", top[1], 2, top[3] + 1, seen, self.ws0), rest[1])]
        if kind == "O":
            node, phase, seen = top[1], top[2], top[3]
            if phase == 4:
                return [(("O", node, 2, seen | {top[4]}, None, self.ws0), rest[1])]
            return self._key_done(top, rest[1], result)
        return []

    def _key_done(self, top, rest, key: str) -> list:
        node, seen = top[1], top[3]
        if key in seen or self._child_of(node, key) is None:
            return []
        kn = node.key_node
        if kn is not None and kn.residual is not None and not self.residual.valid(key, kn.residual):
            return []
        return [(("O", node, 1, seen, key, self.ws0), rest)]

    # ------------------------------------------------------------ containers
    def _object(self, top, rest, b: int, pos: int, ctx: Ctx) -> list:
        _, node, phase, seen, key, ws = top
        if b in WS:
            ws = self.pool.step(ws, b)
            return [(("O", node, phase, seen, key, ws), rest)] if ws != self.pool.NONE else []
        if not self.pool.nullable(ws):
            return []
        if phase == 1:
            if b != 0x3A:
                return []
            child = self._child_of(node, key)
            return [(("V", child, self.ws0), (("O", node, 4, seen, key, 0), rest))]
        if b == 0x22 and phase in (0, 3):
            if node.max_props is not None and len(seen) >= node.max_props:
                return []
            kn = _key_rule(node, seen)
            if kn.never or "string" not in kn.types or (kn.enum is not None and not kn.enum):
                return []
            return [(("S", kn, 0, 0, 0, 0, kn.patterns, ""), (("O", node, phase, seen, None, 0), rest))]
        if b == 0x7D and phase in (0, 2):
            if not (node.required <= seen and len(seen) >= node.min_props):
                return []
            for k in seen:
                deps = node.dep_required.get(k)
                if deps and not set(deps) <= seen:
                    return []
            return self.finish(rest, None, pos + 1, ctx)
        if b == 0x2C and phase == 2:
            if node.max_props is not None and len(seen) >= node.max_props:
                return []
            if node.additional is None and not node.pattern_props and len(seen) >= len(node.props):
                return []
            return [(("O", node, 3, seen, None, self.ws0), rest)]
        return []

    def _array(self, top, rest, b: int, pos: int, ctx: Ctx) -> list:
        _, node, phase, count, seen, ws = top
        if b in WS:
            ws = self.pool.step(ws, b)
            return [(("A", node, phase, count, seen, ws), rest)] if ws != self.pool.NONE else []
        if not self.pool.nullable(ws):
            return []
        if b == 0x5D and phase in (0, 2):
            return self.finish(rest, None, pos + 1, ctx) if count >= node.min_items else []
        if b == 0x2C:
            if phase != 2 or (node.max_items is not None and count >= node.max_items):
                return []
            return [(("A", node, 3, count, seen, self.ws0), rest)] if _item(node, count) is not None else []
        if phase == 2:
            return []
        item = _item(node, count)
        if item is None:
            return []
        inner = (("A", node, 4, count, seen, 0), rest)
        if seen is not None:
            inner = (("U", pos), inner)
        return self.start_value(inner, item, b, pos, ctx)

    def _number(self, top, rest, b: int, pos: int, ctx: Ctx) -> list:
        _, node, text, d = top
        nd = _NUM[d].get(b)
        if nd is not None:
            if len(text) >= MAX_NUMBER_CHARS:
                return []
            if node.integer_only() and nd >= 4:
                return []  # integers are written as integers: no fraction, no exponent
            if nd <= 5 and not node.number_prefix_ok(text + chr(b)):
                return []
            return [(("N", node, text + chr(b), nd), rest)]
        if d not in NUM_COMPLETE or not node.number_ok(text):
            return []
        out: list = []
        for st in self.finish(rest, None, pos, ctx):
            out.extend(self.step(st, b, pos, ctx))
        return out

    # ------------------------------------------------------------ strings
    def _string(self, top, rest, b: int, pos: int, ctx: Ctx) -> list:
        _, node, count, utf, esc, hs, pats, text = top
        if utf:
            need, acc, lo, hi = utf[:4]
            if not lo <= b <= hi:
                return []
            acc = (acc << 6) | (b & 0x3F)
            if need > 1:
                raw = utf[4] + bytes((b,))
                if node.enum is not None and not _enum_next_ok(node, text, lambda c: c.encode().startswith(raw)):
                    return []
                if pats and not self._pats_can(pats, acc, need - 1):
                    return []
                return [(("S", node, count, (need - 1, acc, 0x80, 0xBF, raw), 0, hs, pats, text), rest)]
            return self._feed_counted(node, count, hs, pats, text, acc, rest)
        if esc:
            if esc == 1:
                if b == 0x75:
                    return [(("S", node, count, 0, (0, 0), hs, pats, text), rest)]
                cp = _ESC.get(b)
                return [] if cp is None else self._char(node, count, hs, pats, text, cp, rest)
            v = _HEX.get(b)
            if v is None:
                return []
            n, acc = esc[0] + 1, (esc[1] << 4) | v
            if n < 4 and node.max_len is not None and count >= node.max_len:
                lo = acc << 4 * (4 - n)
                if not hs or lo > 0xDFFF or lo + (1 << 4 * (4 - n)) - 1 < 0xDC00:
                    return []
            if n < 4 and pats and not hs and not self._pats_can(pats, acc, 0, 4 * (4 - n)):
                return []
            if n < 4:
                if node.enum is not None and not _enum_next_ok(node, text, lambda c: _unit_of(c) >> 4 * (4 - n) == acc):
                    return []
                return [(("S", node, count, 0, (n, acc), hs, pats, text), rest)]
            return self._unit(node, count, hs, pats, text, acc, rest)
        if b == 0x22:
            return self._close(node, count, hs, pats, text, rest, pos, ctx)
        if b == 0x5C:
            if node.max_len is not None and count >= node.max_len and not hs:
                return []  # only a low surrogate (counted with its pair) may follow a full string
            if node.enum is not None and not _enum_next_ok(node, text, lambda c: True):
                return []
            return [(("S", node, count, 0, 1, hs, pats, text), rest)]
        if b < 0x20:
            return []
        if b < 0x80:
            return self._char(node, count, hs, pats, text, b, rest)
        u = utf8_start(b)
        if u is None or (node.max_len is not None and count + 1 > node.max_len):
            return []  # a character counts from its first byte, as the mask's counters do
        if node.enum is not None and not _enum_next_ok(node, text, lambda c: c.encode()[0] == b):
            return []
        if pats and not self._pats_can(pats, u[1], u[0]):
            return []
        return [(("S", node, count, u + (bytes((b,)),), 0, hs, pats, text), rest)]

    def _unit(self, node, count, hs, pats, text, cu: int, rest) -> list:
        """A \\uXXXX code unit: surrogate pairs make one character, as JSON decoders do."""
        if hs and 0xDC00 <= cu <= 0xDFFF:
            cp = 0x10000 + ((hs - 0xD800) << 10) + (cu - 0xDC00)
            return self._feed(node, count, 0, pats, text, cp, rest)
        if 0xD800 <= cu <= 0xDBFF:
            got = self._flush(node, hs, pats, text)
            if got is None or (node.max_len is not None and count + 1 > node.max_len):
                return []
            return [(("S", node, count + 1, 0, 0, cu, got[0], got[1]), rest)]
        return self._char(node, count, hs, pats, text, cu, rest)

    def _flush(self, node, hs, pats, text):
        """Feed a pending high surrogate as a lone character: (pats, text) or None (dead)."""
        if not hs:
            return pats, text
        return self._advance_text(node, pats, text, hs)

    def _char(self, node, count, hs, pats, text, cp: int, rest) -> list:
        if node.max_len is not None and count + 1 > node.max_len:
            return []
        got = self._flush(node, hs, pats, text)
        if got is None:
            return []
        return self._feed(node, count + 1, 0, got[0], got[1], cp, rest)

    def _feed_counted(self, node, count, hs, pats, text, cp: int, rest) -> list:
        """The last byte of a multi-byte character (counted at its lead byte)."""
        got = self._flush(node, hs, pats, text)
        if got is None:
            return []
        return self._feed(node, count + 1, 0, got[0], got[1], cp, rest)

    def _feed(self, node, count, hs, pats, text, cp: int, rest) -> list:
        got = self._advance_text(node, pats, text, cp)
        if got is None:
            return []
        return [(("S", node, count, 0, 0, hs, got[0], got[1]), rest)]

    def _advance_text(self, node, pats, text, cp: int):
        if pats:
            step, dead = self.pool.step, self.pool.NONE
            pats = tuple(step(p, cp) for p in pats)
            if dead in pats:
                return None
        if text is not None:
            text += chr(cp)
            enum = node.enum
            if enum is not None:
                i = bisect.bisect_left(enum, text)
                if i == len(enum) or not enum[i].startswith(text):
                    return None
        return pats, text

    def _close(self, node, count, hs, pats, text, rest, pos: int, ctx: Ctx) -> list:
        got = self._flush(node, hs, pats, text)
        if got is None or count < node.min_len:
            return []
        pats, text = got
        if any(not self.pool.nullable(p) for p in pats):
            return []
        if node.enum is not None:
            i = bisect.bisect_left(node.enum, text)
            if i == len(node.enum) or node.enum[i] != text:
                return []
        return self.finish(rest, text, pos + 1, ctx)

    def _pats_can(self, pats, acc: int, need: int, bits: int = -1) -> bool:
        """Every pattern can still take some character whose first bits are `acc`, with
        `need` UTF-8 continuation bytes (6 bits each) or `bits` hex bits still to come: a
        partial character no pattern can finish is refused at its first byte."""
        shift = 6 * need if bits < 0 else bits
        lo, hi = acc << shift, (acc << shift) | ((1 << shift) - 1)
        if bits < 0:  # a UTF-8 sequence of need + 1 bytes encodes at least this code point
            lo = max(lo, _UTF8_FLOOR[need])
        can = self.pool.can_start_in
        return all(can(p, lo, hi) for p in pats)

    def _regex(self, top, rest, b: int) -> list:
        _, term, utf = top
        if utf:
            need, acc, lo, hi = utf
            if not lo <= b <= hi:
                return []
            acc = (acc << 6) | (b & 0x3F)
            if need > 1:
                if not self._pats_can((term,), acc, need - 1):
                    return []
                return [(("R", term, (need - 1, acc, 0x80, 0xBF)), rest)]
            cp = acc
        elif b < 0x80:
            cp = b
        else:
            u = utf8_start(b)
            if u is None or not self._pats_can((term,), u[1], u[0]):
                return []
            return [(("R", term, u), rest)]
        nxt = self.pool.step(term, cp)
        return [] if nxt == self.pool.NONE else [(("R", nxt, 0), rest)]


def _item(node: Node, i: int) -> Optional[Node]:
    return node.prefix[i] if i < len(node.prefix) else node.items


def _key_rule(node: Node, seen: frozenset) -> Node:
    """The key rule of an object with `seen` keys: a closed object's enum less those keys,
    so a key prefix typed can always be finished (memoized on the object node)."""
    kn = node.key_node
    if kn.enum is None or not seen:
        return kn
    memo_key = ("__keys__", seen)
    got = node._child.get(memo_key)
    if got is None:
        got = Node(kn.schema)
        for slot in Node.__slots__:
            if slot not in ("_child",):
                setattr(got, slot, getattr(kn, slot))
        got._child = {}
        got.enum = tuple(k for k in kn.enum if k not in seen)
        node._child[memo_key] = got
    return got


def _unit_of(ch: str) -> int:
    """The first UTF-16 code unit of a character (what a \\u escape spells first)."""
    cp = ord(ch)
    return cp if cp <= 0xFFFF else 0xD800 + ((cp - 0x10000) >> 10)


def _enum_next_ok(node: Node, text: str, pred) -> bool:
    """Some allowed string continues `text` with a character satisfying `pred`: a partial
    character (UTF-8 bytes, a \\u escape) is kept only if it can still become one."""
    memo_key = ("__next__", text)
    nxt = node._child.get(memo_key)
    if nxt is None:
        enum, n = node.enum, len(text)
        i = bisect.bisect_left(enum, text)
        chars = set()
        while i < len(enum) and enum[i].startswith(text):
            if len(enum[i]) > n:
                chars.add(enum[i][n])
            i += 1
        nxt = node._child[memo_key] = frozenset(chars)
    return any(pred(c) for c in nxt)


def _enum_first_bytes(node: Node, text: str) -> frozenset:
    """Bytes that may come next in an enum string after `text`: the first UTF-8 byte of each
    possible next character, the closing quote, a backslash (escapes)."""
    memo_key = ("__first__", text)
    got = node._child.get(memo_key)
    if got is None:
        _enum_next_ok(node, text, lambda c: False)  # fills the next-character set
        got = frozenset(c.encode()[0] for c in node._child[("__next__", text)]) | frozenset(b'"\\')
        node._child[memo_key] = got
    return got
