"""String-body lexeme states made by the C walk (table_walk.c `cfg_lex`).

A string body's inside steps do not read the stack below it (canonical.py: lexemes), nor
of its node more than maxLength, so a state (S frame of node X over stack R) steps on such
a byte to (S' of X over R) where S' is what the first state whose frame differs from S at
most in a node of the same maxLength (its rep) steps to; "below" is then (X, R), a
`StrContext`. The C walk composes that state itself: it
finds (the id of S', the id of R) in an open-addressing map or makes a new state id, and
records where its top frame comes from (`src`); Python builds the tuple only when it
reads the state (`States`). Python-made string states are registered in the same map, so
one (frame, stack below) has one id whichever side met it first.

Whitespace between JSON tokens is such a lexeme as well (kinds 3 / 4): its "below" is a
`WsContext` (the V / O / A frame less its whitespace state, the stack under it), its rep
the first state with the same whitespace state; a non-ws byte is stepped as the
context's first state (`ctxrep`) steps it.
"""
from __future__ import annotations

import ctypes

import numpy as np

from lmprog_runtime.constrained.cfg.machine import WS
from lmprog_runtime.constrained.cfg.untrack import untrack

_GOLDEN, _MASK = 0x9E3779B97F4A7C15, (1 << 64) - 1


class CfgLex(ctypes.Structure):
    """Mirrors cfg_lex in table_walk.c."""

    _fields_ = [("rep", ctypes.c_void_p), ("below", ctypes.c_void_p), ("kind", ctypes.c_void_p),
                ("src", ctypes.c_void_p), ("inside", ctypes.c_void_p), ("lives", ctypes.c_void_p),
                ("map", ctypes.c_void_p), ("map_cap", ctypes.c_int64), ("n", ctypes.c_void_p),
                ("cap", ctypes.c_int32), ("ctxrep", ctypes.c_void_p)]


def _slot(key: int, cap: int) -> int:
    return ((key * _GOLDEN) & _MASK) >> 29 & (cap - 1)


class LexRows:
    """Per-state lexeme fields (rep, below, kind, src: int32 / uint8 [cap]), the map
    (rep, below) -> id (int64 [map_cap x 2]) and the state count shared with C."""

    def __init__(self):
        self.struct = CfgLex()
        self.n = np.zeros(1, dtype=np.int32)  # states in the table (C increments it too)
        self.clear(64)

    def clear(self, cap: int) -> None:
        self.n[0] = 0
        self.below_ids: dict = {}  # stack below a string frame -> its id
        self.rep = np.full(cap, -1, dtype=np.int32)
        self.below = np.full(cap, -1, dtype=np.int32)
        self.kind = np.zeros(cap, dtype=np.uint8)
        self.src = np.full(cap, -1, dtype=np.int32)
        self.ctxrep = np.full(cap, -1, dtype=np.int32)  # per below id: a whitespace context's first state
        self._new_map(4 * cap)
        self.struct.n = self.n.ctypes.data

    def grow(self, cap: int, inside: np.ndarray, lives: np.ndarray, limit: int) -> None:
        """Arrays to `cap` rows; C makes states while n < min(cap, limit)."""
        old = len(self.rep)
        if cap > old:
            self.rep = np.concatenate([self.rep, np.full(cap - old, -1, dtype=np.int32)])
            self.below = np.concatenate([self.below, np.full(cap - old, -1, dtype=np.int32)])
            self.kind = np.concatenate([self.kind, np.zeros(cap - old, dtype=np.uint8)])
            self.src = np.concatenate([self.src, np.full(cap - old, -1, dtype=np.int32)])
            self.ctxrep = np.concatenate([self.ctxrep, np.full(cap - old, -1, dtype=np.int32)])
            entries = self.map[self.map[:, 0] != -1]
            self._new_map(4 * cap)
            self._put_all(entries)
        st = self.struct
        st.rep, st.below, st.kind, st.src, st.ctxrep = (a.ctypes.data for a in (self.rep, self.below, self.kind,
                                                                               self.src, self.ctxrep))
        st.inside, st.lives, st.cap = inside.ctypes.data, lives.ctypes.data, min(cap, limit)

    def nbytes(self) -> int:
        return (self.rep.nbytes + self.below.nbytes + self.kind.nbytes + self.src.nbytes + self.ctxrep.nbytes
                + self.map.nbytes)

    def _new_map(self, cap: int) -> None:
        self.map = np.full((cap, 2), -1, dtype=np.int64)
        self._flat = memoryview(self.map.reshape(-1))  # (key, value) at [2 slot], [2 slot + 1]: Python ints
        self.struct.map, self.struct.map_cap = self.map.ctypes.data, cap

    def _put_all(self, entries: np.ndarray) -> None:
        """(key, value) rows into the empty map, all at once: each round, the keys whose
        probe slot is free and first among the round's claims on it take it, the others
        probe on (a probe chain then crosses only filled slots, as `_put` leaves it)."""
        cap = len(self.map)
        keys, values = entries[:, 0], entries[:, 1]
        slots = ((keys.astype(np.uint64) * np.uint64(_GOLDEN)) >> np.uint64(29)).astype(np.int64) & (cap - 1)
        pending = np.arange(len(keys))
        while len(pending):
            s = slots[pending]
            free = self.map[s, 0] == -1
            _, first = np.unique(s[free], return_index=True)
            won = pending[free][first]
            self.map[slots[won], 0], self.map[slots[won], 1] = keys[won], values[won]
            lost = np.ones(len(pending), dtype=np.bool_)
            lost[np.flatnonzero(free)[first]] = False
            pending = pending[lost]
            slots[pending] = (slots[pending] + 1) & (cap - 1)

    def _probe(self, key: int) -> int:
        """The slot holding `key`, or the empty slot its probe chain ends at."""
        flat, cap = self._flat, len(self.map)
        slot = _slot(key, cap)
        got = flat[2 * slot]
        while got != -1 and got != key:
            slot = (slot + 1) & (cap - 1)
            got = flat[2 * slot]
        return slot

    def _put(self, key: int, value: int) -> None:
        """key -> value, unless the map holds key (met first by the C walk, or by another state)."""
        slot, flat = self._probe(key), self._flat
        if flat[2 * slot] == -1:
            flat[2 * slot], flat[2 * slot + 1] = key, value

    def find(self, rep: int, below) -> int:
        """The id of (frame of state `rep`, stack `below`), or -1."""
        b = self.below_ids.get(below)
        if b is None:
            return -1
        slot, flat = self._probe((rep << 32) | b), self._flat
        return flat[2 * slot + 1] if flat[2 * slot] != -1 else -1

    def ws_source(self, s: int, b: int):
        """The state whose step on b the C walk reads whitespace state s's off (its
        context's first state for a non-ws byte, its whitespace state's first for a ws
        byte), or None (not a whitespace state, or s is that state)."""
        if self.kind[s] < 3:
            return None
        r = int(self.ctxrep[self.below[s]]) if b not in WS else int(self.rep[s])
        return r if r >= 0 and r != s else None

    def register(self, n: int, rep: int, below, kind: int) -> None:
        """Python interned string state n (its frame's first state `rep`, over `below`)."""
        b = self.below_ids.setdefault(below, len(self.below_ids))
        if b == len(self.below_ids) - 1:
            untrack(below)  # (a new context: immutable, untrack.py)
        self.rep[n], self.below[n], self.kind[n] = rep, b, kind
        if kind >= 3 and self.ctxrep[b] < 0:
            self.ctxrep[b] = n
        self._put((rep << 32) | b, n)


def ws_of(frame: tuple) -> int:
    """The whitespace state of a V / O / A frame."""
    return frame[2] if frame[0] == "V" else frame[5]


class StrContext(tuple):
    """(a plain string body's node, the stack under its frame): string states of different
    nodes with the same maxLength share their steps (a rep), each in its own context."""

    __slots__ = ()

    @classmethod
    def of(cls, st) -> "StrContext":
        return cls((st[0][1], st[1]))


class WsContext(tuple):
    """(a V / O / A frame with its whitespace state set to None, the stack under it)."""

    __slots__ = ()

    def state(self, ws: int) -> tuple:
        frame = self[0]
        at = 2 if frame[0] == "V" else 5
        return (frame[:at] + (ws,) + frame[at + 1:], self[1])

    @classmethod
    def of(cls, st) -> "WsContext":
        frame = st[0]
        at = 2 if frame[0] == "V" else 5
        return cls((frame[:at] + (None,) + frame[at + 1:], st[1]))


def ws_lexeme(pool, state: tuple, kinds: dict):
    """(table_walk.c's kind: 3 a ws byte may follow, 4 none may; the whitespace state;
    its WsContext) of a state in whitespace between JSON tokens (one stack, a V / O / A
    frame on top with a nullable whitespace state), or None. kinds: whitespace state ->
    its kind, or 0 where it is not nullable (the caller's, per grammar)."""
    if len(state) != 1 or state[0] is None:
        return None
    top = state[0][0]
    kind = top[0] if type(top) is tuple else None
    if kind not in ("V", "O", "A") or (kind != "V" and top[2] == 4):
        return None
    ws = top[2] if kind == "V" else top[5]
    got = kinds.get(ws)
    if got is None:
        got = kinds[ws] = (0 if not pool.nullable(ws) else
                           3 if any(pool.step(ws, c) != pool.NONE for c in WS) else 4)
    return (got, ws, WsContext.of(state[0])) if got else None


def string_shape(top: tuple) -> tuple:
    """What a plain string body's inside steps read of its S frame: all but the node, of
    which only maxLength, and minLength for the canonical count (clamped at it when there
    is no maxLength; the closing quote, which reads it too, ends the lexeme)."""
    return (top[1].max_len, top[1].min_len) + top[2:]


class States(list):
    """The table's states by id; an id the C walk made (None here) is built on first read:
    the top frame of its `src` state over the stack below of its id."""

    def __init__(self, table):
        super().__init__()
        self.table = table
        self._belows: list = []

    def __getitem__(self, i):
        got = list.__getitem__(self, i)
        if got is None:
            tab = self.table
            lx = tab.lexrows
            if len(self._belows) < len(lx.below_ids):
                self._belows = list(lx.below_ids)
            src = list.__getitem__(self, int(lx.src[i]))  # (made by Python: a rep's step)
            below = self._belows[int(lx.below[i])]
            if type(below) is WsContext:  # the context's frame with src's whitespace state
                got = (below.state(ws_of(src[0][0])),)
            else:  # src's frame with the context's node, over the context's stack
                got = ((src[0][0][:1] + (below[0],) + src[0][0][2:], below[1]),)
            list.__setitem__(self, i, got)
            tab.ids.setdefault(got, i)
            untrack(got)
        return got

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def sync(self, n: int) -> None:
        """Room for the ids up to n (those C made since)."""
        if n > len(self):
            self.extend([None] * (n - len(self)))
