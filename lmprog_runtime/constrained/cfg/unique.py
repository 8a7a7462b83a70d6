"""Masks inside a uniqueItems array with items seen, without reading the items.

A token that completes an item is refused when the item equals one seen before; otherwise
the array's items seen change nothing of a mask. The C walk reads them by replaying every
token that completes an item from the concrete state (table.py `_concrete`): in an array of
strings, every mask from the second item on replays the ~40 tokens that can close a string
(~0.6 ms a mask, and none is shared: the key holds the items seen). Here such a mask is the
mask of the same state with none seen (no item's text read: Machine.finish's first item,
memoized like any), less the tokens that complete an item equal to one seen, looked up by
the item's value in tables of the vocabulary (`UniqueTokens`): the tokens whose text before
their first closing quote spells the rest of a seen string, or that begin with a whole seen
item (a string, a number followed by what ends it, a container) or literal. A token that
may complete a second item after a comma within it is checked against the concrete state,
as the walk would.

Where this holds exactly (`unique_mask` returns None elsewhere, and the walk decides): one
state; the array's item rule free (a string of no pattern, enum or maxLength, or any value:
after a token that completes nothing, some next byte goes on whatever was seen, so the mask's
byte of lookahead reads no item either), or of strings alone with a pattern or maxLength
(a string may then have to end where a seen one does: the tokens that spell a seen string's
rest to its end, or open it and spell it whole, are stepped from the concrete state too); the
state either inside a string item at a character boundary, or between items (after a comma,
for a rule that is not free), or nested inside an item of a rule that takes any value and
checks nothing (`[{"a":[1`: after any token some byte goes on without completing the
item), where only a token closing every container open in the item can complete it: those
(`UniqueTokens.closing_depth`, by the depth their `]` / `}` take them below where they
begin, strings skipped) are stepped from the concrete state, the rest are the mask's with
none seen (stop 51: the suite's uniqueItems masks 18-20 -> 13-15 ms in all, `[[1],[true` 1.4
ms -> 0.07).
"""
from __future__ import annotations

import json
import re
from decimal import Decimal
from typing import Optional

import numpy as np

from lmprog_runtime.constrained.cfg.table import _ctx, _replay
from lmprog_runtime.constrained.schema_merge import equality_form

_WS = b" \t\n\r"
# a second value completed after a comma inside one token (its first byte for a literal,
# which a literal item is checked at)
_SECOND = re.compile(rb',[ \t\n\r]*(?:"(?:[^"\\]|\\.)*"|[tfn]|-?[0-9][0-9.eE+-]*[^0-9.eE+-]|[\[{].*[\]}])', re.S)
_LITERALS = {ord("t"): ("b", True), ord("f"): ("b", False), ord("n"): ("z",)}  # (schema_merge.equality_form's forms)
_VALUE_START = frozenset(b'"{[-0123456789')
_NUMBER_START = frozenset(b"-0123456789")
_NUMBER_BYTES = frozenset(b"0123456789.eE+-")
_DECODER = json.JSONDecoder(parse_float=Decimal, parse_int=Decimal)  # (as residual.canonical reads a value)


def _closing_quote(data: bytes) -> int:
    """Index of the first quote of `data` read inside a string body (escapes skipped), or -1."""
    i = 0
    while i < len(data):
        b = data[i]
        if b == 0x5C:
            i += 2
            continue
        if b == 0x22:
            return i
        i += 1
    return -1


def _whole_item(head: bytes):
    """The value (residual.py's canonical form) of the item `head` begins with, where it is
    complete within it (a number then followed by a byte that is not a number's), else None."""
    try:
        value, end = _DECODER.raw_decode(head.decode("utf-8"))
    except (ValueError, UnicodeDecodeError):
        return None
    if head[0] in _NUMBER_START:
        if head[:2] == b"-I" or end >= len(head) or head[end] in _NUMBER_BYTES:
            return None  # (-Infinity is no JSON; a number at the token's end may go on)
    return equality_form(value)


def _dip(data: bytes, inside: bool) -> int:
    """How many containers `data` closes below its start (the lowest depth its `]` / `}`
    take it to, JSON strings and their escapes skipped), read from inside a string body
    (at a character boundary) where `inside`."""
    depth = low = 0
    escaped = False
    for b in data:
        if inside:
            if escaped:
                escaped = False
            elif b == 0x5C:
                escaped = True
            elif b == 0x22:
                inside = False
        elif b == 0x22:
            inside = True
        elif b == 0x5B or b == 0x7B:
            depth += 1
        elif b == 0x5D or b == 0x7D:
            depth -= 1
            low = min(low, depth)
    return -low


def _decoded(body: bytes) -> Optional[str]:
    try:
        return json.loads(b'"' + body + b'"')
    except (ValueError, UnicodeDecodeError):
        return None


class UniqueTokens:
    """Per vocabulary (VocabInfo.unique, made with it: ~30 ms at 49k tokens): the tokens
    that complete an item, by the item's value."""

    def __init__(self, table):
        closing: dict = {}   # text before the first closing quote, read inside a string -> ids
        items: dict = {}     # a whole item (after whitespace) at the token's start -> ids, by its value
        literals: dict = {}  # a literal item's first byte (after whitespace) -> ids, by its value
        content: dict = {}   # a token's text read inside a string, where it has no closing quote -> ids
        opening: dict = {}   # the same after an opening quote (after whitespace) at the token's start
        second = []
        for tok, data in enumerate(table):
            if not data:
                continue
            q = _closing_quote(data) if b'"' in data else -1
            if q >= 0:
                got = _decoded(data[:q])
                if got is not None:
                    closing.setdefault(got, []).append(tok)
            elif b"\\" in data:  # (raw ones are found by their bytes: VocabInfo's own table)
                got = _decoded(data)
                if got is not None:
                    content.setdefault(got, []).append(tok)
            head = data.lstrip(_WS)
            if head[:1] == b'"' and _closing_quote(head[1:]) < 0:
                got = _decoded(head[1:])
                if got is not None:
                    opening.setdefault(got, []).append(tok)
            if head and head[0] in _LITERALS:
                literals.setdefault(_LITERALS[head[0]], []).append(tok)
            elif head and head[0] in _VALUE_START:
                got = _whole_item(head)
                if got is not None:
                    items.setdefault(got, []).append(tok)
            if b"," in data and _SECOND.search(data):
                second.append(tok)
        self.closing = {k: np.asarray(v, dtype=np.int64) for k, v in closing.items()}
        self.items = {k: np.asarray(v, dtype=np.int64) for k, v in items.items()}
        self.literals = {k: np.asarray(v, dtype=np.int64) for k, v in literals.items()}
        self.second = np.asarray(second, dtype=np.int64)
        # (how many containers a token closes below where it begins, read outside a string
        # and inside one: one that completes an item nested n containers deep closes n)
        self.dips = [np.zeros(len(table), dtype=np.int64) for _ in range(2)]
        for tok, data in enumerate(table):
            if data and (b"]" in data or b"}" in data):
                for inside in (0, 1):
                    self.dips[inside][tok] = _dip(data, bool(inside))
        self._closing: dict = {}  # (n, inside) -> the ids of tokens closing n containers or more
        self.escaped = {k: np.asarray(v, dtype=np.int64) for k, v in content.items()}
        self.opening = {k: np.asarray(v, dtype=np.int64) for k, v in opening.items()}
        # (bytes -> the first token id, and the rare repeats apart: ~49k entries of ints, no
        # per-token list or array for the garbage collector to walk)
        self.raw: dict = {}
        self.raw_repeats: dict = {}
        for tok, data in enumerate(table):
            if data and b'"' not in data and b"\\" not in data:
                if data in self.raw:
                    self.raw_repeats[data] = self.raw_repeats.get(data, ()) + (tok,)
                else:
                    self.raw[data] = tok

    def closing_depth(self, n: int, inside: bool) -> np.ndarray:
        """The ids of the tokens that close `n` or more containers below where they begin
        (inside a string body where `inside`)."""
        got = self._closing.get((n, inside))
        if got is None:
            got = self._closing[(n, inside)] = np.flatnonzero(self.dips[inside] >= n)
        return got

    def spelling(self, text: str) -> list:
        """The token ids whose bytes, read inside a string, are exactly `text` (no quote)."""
        out = []
        data = text.encode("utf-8", "surrogatepass")
        got = self.raw.get(data)
        if got is not None:
            out.append(np.asarray((got,) + self.raw_repeats.get(data, ()), dtype=np.int64))
        got = self.escaped.get(text)
        if got is not None:
            out.append(got)
        return out


def _plain(node) -> bool:
    """An item rule checked by nothing but its own keywords, a string among its kinds."""
    return node is not None and node.alts is None and node.residual is None and not node.never and "string" in node.types


def _free(node) -> bool:
    """A plain item rule after whose tokens some next byte goes on whatever items were seen:
    a string of no pattern, enum or maxLength (or any value)."""
    return _plain(node) and node.enum is None and not node.patterns and node.max_len is None


def _strings_only(node) -> bool:
    """A plain item rule of strings alone, no enum (a pattern or maxLength may make a string
    end where a seen one does: the tokens that spell one to its end are stepped,
    `unique_mask`). An enum's item is begun under the enum less the items seen (Machine.
    _unseen: a seen member's prefix no other shares is refused at its first byte), which
    the mask with none seen does not tell: the walk decides there."""
    return _plain(node) and node.types <= {"string"} and node.enum is None


def _split(st):
    """(the frames above the array, the array frame, the stack below it, where: "string" /
    "between" / "nested", whether the item rule is free or, "nested", the containers open in
    the item) for a state one of whose uniqueItems arrays has items seen and applies, else
    None."""
    above = []
    while st is not None:
        frame = st[0]
        if frame[0] == "A" and frame[4]:
            break
        above.append(frame)
        st = st[1]
    else:
        return None
    arr = st[0]
    node = arr[1]
    item = node.prefix[arr[3]] if arr[3] < len(node.prefix) else node.items
    free = _free(item)
    if not (free or _strings_only(item)):
        return None
    if not above:
        return (above, arr, st[1], "between", free) if free or arr[2] == 3 else None
    if len(above) == 2 and above[1][0] == "U" and above[0][0] == "S":
        top = above[0]  # ("S", node, count, utf, esc, hs, pats, text)
        if not (top[3] or top[4] or top[5]) and _plain(top[1]):
            return above, arr, st[1], "string", free and _free(top[1])
    if free and len(above) > 2 and above[-1][0] == "U":
        opened = _opened(above[:-1])
        if opened:
            return above, arr, st[1], "nested", opened
    return None


def _opened(frames) -> int:
    """The arrays and objects open in `frames` (an item's, above its U frame), where each
    frame is of a rule that takes any value and checks nothing (so that some byte after any
    token goes on without completing the item, whatever was seen) and a string on top is at
    a character boundary, else 0."""
    top = frames[0]
    if top[0] == "S" and (top[3] or top[4] or top[5]):
        return 0
    n = 0
    for frame in frames:
        kind = frame[0]
        if kind == "L":
            continue
        if kind not in ("V", "O", "A", "S", "N") or frame[1].name != "any" or frame[1].residual is not None:
            return 0
        if kind in ("O", "A"):
            n += 1
    return n


def unique_mask(engine, key, state: tuple, hist: bytes) -> Optional[np.ndarray]:
    """The walked part of `state`'s mask (as MaskEngine._masked computes it, packed) from
    that of the state with none seen, or None where that does not hold (module docstring)."""
    if len(state) != 1 or state[0] is None:
        return None
    split = _split(state[0])
    if split is None:
        return None
    above, arr, below, where, free = split
    seen = arr[4]
    tables = engine.vocab.unique
    drop = []
    check = [tables.second]  # (tokens stepped from the concrete state where the mask with none seen has them)
    if where == "nested":  # (a token that completes the item closes every container open in it)
        check = [tables.closing_depth(free, above[0][0] == "S")]
    elif where == "string":
        start = above[1][1]  # (the U frame: the item's first byte, its opening quote)
        typed = _decoded(bytes(hist[start + 1:]))
        if typed is None or (typed and 0xD800 <= ord(typed[-1]) <= 0xDBFF):
            return None  # (a high surrogate typed last: its pair may come in the token)
        for v in seen:
            if v[0] == "s" and v[1].startswith(typed):
                got = tables.closing.get(v[1][len(typed):])
                if got is not None:
                    drop.append(got)
                if not free:  # (a token that spells the rest: after it, the quote may be all that can come)
                    check.extend(tables.spelling(v[1][len(typed):]))
    elif arr[2] == 3:  # (after a comma: an item begins within the next token)
        for v in seen:
            got = (tables.literals if v[0] in ("b", "z") else tables.items).get(v)
            if got is not None:
                drop.append(got)
            if not free and v[0] == "s":  # (a token that opens a seen string and spells it to its end)
                got = tables.opening.get(v[1])
                if got is not None:
                    check.append(got)
    none = (arr[:4] + (frozenset(),) + arr[5:], below)
    for frame in reversed(above):
        none = (frame, none)
    state0 = (none,)
    got = engine._masked(engine._fast_key(state0) if key is not None else None, state0, hist)
    ids = np.concatenate(check) if len(check) > 1 else check[0]
    if len(ids):
        maybe = ids[(got[ids >> 3] >> (ids & 7)) & 1 == 1]
        drop.extend(np.asarray([t], dtype=np.int64) for t in set(maybe.tolist())
                    if not _allowed(engine, state, hist, engine.vocab.table[t]))
    if not drop:
        return got  # (no token completes a seen item here: the very mask with none seen, shared)
    out = got.copy()
    _clear(out, np.concatenate(drop))
    return out


def _clear(packed: np.ndarray, ids: np.ndarray) -> None:
    np.bitwise_and.at(packed, ids >> 3, (~(np.uint8(1) << (ids & 7).astype(np.uint8))).astype(np.uint8))


def _allowed(engine, state: tuple, hist: bytes, data: bytes) -> bool:
    """The token `data` is allowed from the concrete `state` (stepped byte by byte, then one
    byte of lookahead: MaskEngine._lives)."""
    path = bytearray(data) + bytearray(2)  # (the lookahead byte is written past the token)
    ctx = _ctx(hist, path)
    state = _replay(engine.machine, state, hist, data, ctx)
    return bool(state) and engine._lives(state, len(hist) + len(data), ctx, path, len(data))
