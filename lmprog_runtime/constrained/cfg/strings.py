"""String bodies of the pushdown matcher (machine.py): UTF-8 and escape decoding,
character counters, pattern states, enum prefixes, and the whole-output regex frame.

Mixed into `Machine`; frames are documented there. A character is counted at its first
byte (so a token cut inside a character is measured like the mask's counters measure it),
and a partial character — UTF-8 bytes or `\\u` digits — is refused at the first byte that
no pattern state or enum member can finish.
"""
from __future__ import annotations

import bisect
from typing import Callable, Optional

from lmprog_runtime.constrained.cfg.nodes import Node

Ctx = Callable[[int, int], bytes]  # output bytes [start, end)
_ESC = {0x22: 0x22, 0x5C: 0x5C, 0x2F: 0x2F, 0x62: 8, 0x66: 12, 0x6E: 10, 0x72: 13, 0x74: 9}
_HEX = {**{0x30 + i: i for i in range(10)}, **{a + i: 10 + i for a in (0x41, 0x61) for i in range(6)}}  # 0-9 A-F a-f
_UTF8_FLOOR = (0, 0x80, 0x800, 0x10000)
_ESC_BYTES = frozenset(_ESC) | {0x75}
_BODY_BYTES = frozenset(range(0x20, 0x80)) | frozenset(range(0xC2, 0xF5))  # (utf8_start's lead bytes)


class _Free:
    """The text of a string body in a mask table's state (cfg/table.py): a key's text
    abstracted away, never read (the table leaves the closing quote to the Python walk)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "FREE"


FREE = _Free()


class _Extra:
    """The key of an object frame in a mask table's state (canonical.py): a key whose member
    rule is additionalProperties, abstracted away; read only where the value ends (it joins
    the frame's seen keys), which a table derivation leaves to the Python walk."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "EXTRA"


EXTRA = _Extra()


def _utf8(text: str) -> bytes:
    """`text` in UTF-8, a lone surrogate (JSON spells one only as a `\\u` escape) as the
    three bytes no UTF-8 decoder takes: it matches no raw output."""
    return text.encode("utf-8", "surrogatepass")


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


def _utf8_lead(cp: int) -> int:
    """The first UTF-8 byte of code point cp >= 0x80 (surrogates too: _pats_can's ranges hold them)."""
    return 0xC0 | cp >> 6 if cp < 0x800 else 0xE0 | cp >> 12 if cp < 0x10000 else 0xF0 | cp >> 18


class StringFrames:
    """S and R frames (needs self.pool, self.finish)."""

    def _string(self, top, rest, b: int, pos: int, ctx: Ctx) -> list:
        _, node, count, utf, esc, hs, pats, text = top
        if utf:
            need, acc, lo, hi = utf[:4]
            if not lo <= b <= hi:
                return []
            acc = (acc << 6) | (b & 0x3F)
            if need > 1:
                raw = utf[4] + bytes((b,))
                if node.enum is not None and not _enum_next_ok(node, text, lambda c: _utf8(c).startswith(raw)):
                    return []
                if pats and not self._pats_can(pats, acc, need - 1, left=self._left(node, count, hs)):
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
            if n < 4 and pats and not hs and not self._pats_can(pats, acc, 0, 4 * (4 - n), self._left(node, count, hs)):
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
            if pats and not hs and not self._pats_can(pats, 0, 0, 21, self._left(node, count, hs)):
                return []  # an escape spells a character: refused where no pattern takes any more
            return [(("S", node, count, 0, 1, hs, pats, text), rest)]
        if b < 0x20:
            return []
        if b < 0x80:
            return self._char(node, count, hs, pats, text, b, rest)
        u = utf8_start(b)
        if u is None or (node.max_len is not None and count + 1 > node.max_len):
            return []  # a character counts from its first byte, as the mask's counters do
        if node.enum is not None and not _enum_next_ok(node, text, lambda c: _utf8(c)[0] == b):
            return []
        if pats and not self._pats_can(pats, u[1], u[0], left=self._left(node, count, hs)):
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
        if got is None or not self._fits(node, count, got[0]):
            return []
        return [(("S", node, count, 0, 0, hs, got[0], got[1]), rest)]

    def _fits(self, node, count: int, pats) -> bool:
        """Under maxLength, every pattern can still match within the characters left after
        `count` (RegexPool.min_chars): a character after which a pattern needs more
        characters than are left is refused, not the string's closing quote later
        (`{"maxLength": 4, "pattern": "b"}` took `"xyza` and then nothing); the first bytes
        of a character, by `_pats_can`'s `left`."""
        if node.max_len is None or not pats:
            return True
        return count + max(self.pool.min_chars(p) for p in pats) <= node.max_len

    @staticmethod
    def _left(node, count: int, hs) -> Optional[int]:
        """The characters left after the one begun at `count` (None: no maxLength, or a
        high surrogate pending, which the patterns have not read yet)."""
        return None if node.max_len is None or hs else node.max_len - count - 1

    def _advance_text(self, node, pats, text, cp: int):
        if pats:
            step, dead = self.pool.step, self.pool.NONE
            pats = tuple(step(p, cp) for p in pats)
            if dead in pats:
                return None
        if text is not None and text is not FREE:
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

    def string_bytes(self, state: tuple):
        """Where `candidates` allows any byte, a superset of the bytes `advance` may accept
        when every alternative is a string body (a set), else None: inside a UTF-8
        character its next byte's range, after `\\` the escape letters, in `\\u` the hex
        digits, else the quote, `\\`, printable ASCII and UTF-8 lead bytes (with patterns:
        the first bytes of characters every pattern can take). For the mask table's dead
        bytes only: `candidates`' None also says that a token ending in the state lives,
        which this leaves as it is."""
        out: set = set()
        for st in state:
            top = st[0] if st is not None else None
            if top is None or top[0] != "S":
                return None
            utf, esc = top[3], top[4]
            if utf:
                out.update(range(utf[2], utf[3] + 1))
            elif esc:
                out.update(_ESC_BYTES if esc == 1 else _HEX)
            elif top[6] and not top[5]:
                out.update(self._pattern_first_bytes(top[6]))
            else:
                out.update(_BODY_BYTES)
        return out

    def _pattern_first_bytes(self, pats: tuple) -> frozenset:
        """The quote, `\\`, and the printable ASCII and UTF-8 lead bytes that start a
        character every pattern of `pats` can take (memoized per patterns)."""
        got = self._pattern_bytes.get(pats)
        if got is None:
            firsts = [self.pool.first(p) for p in pats]
            out = {0x22, 0x5C}
            out.update(set.intersection(*({c for lo, hi in rs for c in range(max(lo, 0x20), min(hi, 0x7F) + 1)}
                                          for rs in firsts)))
            out.update(set.intersection(*({b for lo, hi in rs if hi >= 0x80 for b in
                                           range(_utf8_lead(max(lo, 0x80)), _utf8_lead(hi) + 1)} for rs in firsts)))
            if len(self._pattern_bytes) >= 4096:
                self._pattern_bytes.clear()
            got = self._pattern_bytes[pats] = frozenset(out)
        return got

    def _pats_can(self, pats, acc: int, need: int, bits: int = -1, left: Optional[int] = None) -> bool:
        """Every pattern can still take some character whose first bits are `acc`, with
        `need` UTF-8 continuation bytes (6 bits each) or `bits` hex bits still to come (and,
        `left` characters left after it, still match within them: RegexPool.can_start_in):
        a partial character no pattern can finish is refused at its first byte."""
        shift = 6 * need if bits < 0 else bits
        lo, hi = acc << shift, (acc << shift) | ((1 << shift) - 1)
        if bits < 0:  # a UTF-8 sequence of need + 1 bytes encodes at least this code point
            lo = max(lo, _UTF8_FLOOR[need])
        can = self.pool.can_start_in
        return all(can(p, lo, hi, left) for p in pats)

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
        got = frozenset(_utf8(c)[0] for c in node._child[("__next__", text)]) | frozenset(b'"\\')
        node._child[memo_key] = got
    return got
