"""Masks walked in C against a lazily filled transition table of interned matcher states.

A matcher state with no pending capture (no C / U frame: nothing reads the output text or
its position) is a pure function of itself: from it, byte b always leads to the same next
state, and whether a token may end in it (the one-byte lookahead of `MaskEngine._lives`)
is fixed. Such states are interned (tuple -> int id) and their transitions kept in an
int32 table [states x 256], filled on demand: the C walk (table_walk.c) runs over the
trie until it meets a transition or a liveness not derived yet, returns to Python to
derive it (`Machine.advance`, once per state and byte, ever), and resumes. Bytes outside
`Machine.candidates` are dead when a state is interned, so structural states cost a few
derivations. A transition into a state that does capture (a residual check, a
uniqueItems item) is marked PYTHON: that subtree is walked by the Python walk of mask.py
(`MaskEngine._walk_py`, also the oracle of the tests and the path where no C compiler
exists). The table is per grammar: it outlives masks, so a state met in a new context
(the same string body at another count, the same object after another member) reuses
what earlier walks derived. Memory: 1 KB per state; past SOFT_STATES the table is
emptied before the next walk, past HARD_STATES a walk marks new transitions PYTHON.
"""
from __future__ import annotations

import ctypes
import pathlib
from typing import Optional

import numpy as np

from lmprog_runtime import native
from lmprog_runtime.constrained.cfg.machine import Machine
from lmprog_runtime.constrained.cfg.strings import FREE

UNKNOWN, DEAD, PYTHON = -1, -2, -3  # table_walk.c's transition markers
IN_PYTHON = 3  # liveness that reads the output text (table_walk.c stops there: a Python subtree)
SOFT_STATES = 4096
HARD_STATES = 16384
_SOURCE = pathlib.Path(__file__).with_name("table_walk.c")


def _declare(lib: ctypes.CDLL) -> None:
    ptr, i32 = ctypes.c_void_p, ctypes.c_int32
    lib.cfg_table_walk.argtypes = [ptr, ptr, ptr, i32, i32, ptr, ptr, ptr]
    lib.cfg_table_walk.restype = i32


_KERNEL = native.Kernel(_SOURCE, ("-O2",), False, _declare)


def c_table_walker() -> Optional[ctypes.CDLL]:
    """The C walk, built once per source version; None where it cannot be built."""
    return _KERNEL.lib()


def canonical(state: tuple) -> tuple:
    """`state` with what no transition but a string's closing quote reads abstracted away:
    a string body's text (kept for keys; enum strings keep theirs) becomes FREE, and with
    no maxLength its character count is clamped at minLength (only `count < minLength`
    is ever read). The table's transitions from such a state are exact for every byte but
    that quote, which `_derive` leaves to the Python walk (PYTHON)."""
    out = None
    for k, st in enumerate(state):
        if st is None:
            continue
        if _captures(st):
            out = list(state) if out is None else out
            out[k] = st = _unplace(st)
        top = st[0]
        if type(top) is not tuple or top[0] != "S":
            continue
        node, count, text = top[1], top[2], top[7]
        if node.enum is not None:
            continue
        if node.max_len is None and count > node.min_len:
            count = node.min_len
        if text is not None:
            text = FREE
        if count != top[2] or text is not top[7]:
            out = list(state) if out is None else out
            out[k] = ((top[0], node, count) + top[3:7] + (text,), st[1])
    return state if out is None else tuple(dict.fromkeys(out))


def _captures(st) -> bool:
    while st is not None:
        frame = st[0]
        if type(frame) is tuple and frame and frame[0] in ("C", "U"):
            return True
        st = st[1]
    return False


def _unplace(st):
    """A stack with its C / U frames' start offsets set to -1 (read only through ctx)."""
    frames = []
    while st is not None:
        frames.append(st[0])
        st = st[1]
    out = None
    for f in reversed(frames):
        if f[0] == "C":
            f = ("C", f[1], -1)
        elif f[0] == "U":
            f = ("U", -1)
        out = (f, out)
    return out


def _has_free(state: tuple) -> bool:
    for st in state:
        top = st[0] if st is not None else None
        if type(top) is tuple and top[0] == "S" and top[7] is FREE:
            return True
    return False


class StateTable:
    """Interned pure states of one grammar, their transitions and liveness."""

    def __init__(self, machine):
        self.machine = machine
        self._rows: dict = {}  # candidates frozenset -> its initial table row
        self.reset()

    def reset(self) -> None:
        self.ids: dict = {}
        self.states: list = []
        self.trans = np.full(64 * 256, UNKNOWN, dtype=np.int32)
        self.lives = np.zeros(64, dtype=np.uint8)
        self.addr = (self.trans.ctypes.data, self.lives.ctypes.data)

    def intern(self, state: tuple) -> int:
        """The id of a pure state (interned on first sight, dead bytes filled in);
        PYTHON when the table is full."""
        got = self.ids.get(state)
        if got is not None:
            return got
        n = len(self.states)
        if n >= HARD_STATES:
            return PYTHON
        if n == len(self.lives):
            self.trans = np.concatenate([self.trans, np.full(n * 256, UNKNOWN, dtype=np.int32)])
            self.lives = np.concatenate([self.lives, np.zeros(n, dtype=np.uint8)])
            self.addr = (self.trans.ctypes.data, self.lives.ctypes.data)
        self.ids[state] = n
        self.states.append(state)
        cands = self.machine.candidates(state)
        if cands is not None:
            cands = frozenset(cands)
            row = self._rows.get(cands)
            if row is None:
                row = self._rows[cands] = np.full(256, DEAD, dtype=np.int32)
                row[list(cands)] = UNKNOWN
            self.trans[n * 256:(n + 1) * 256] = row
        return n


class TableWalker:
    """The C walk of one grammar's masks (`walk`), falling back to the engine's Python walk
    for subtrees whose states capture output."""

    def __init__(self, engine, lib: ctypes.CDLL):
        self.engine, self.lib = engine, lib
        self.table = StateTable(engine.machine)
        # JSON / regex states are canonicalized; EBNF states (ebnf.py) are pure as they are
        self._json = isinstance(engine.machine, Machine)
        self._canon = canonical if self._json else (lambda state: state)
        self._stack = np.zeros(257, dtype=np.int32)
        self._at = np.zeros(1, dtype=np.int32)

    def walk(self, state: tuple, hist: bytes, trie, lists) -> np.ndarray:
        """bool [n_slots]: the tokens of `trie` allowed from `state` (the Python walk's result)."""
        eng, tab = self.engine, self.table
        if len(tab.states) > SOFT_STATES:
            tab.reset()
        root = tab.intern(self._canon(state))
        if root == PYTHON:
            return eng._walk_py(state, hist, trie, lists)
        out = np.zeros(eng.vocab.n_slots, dtype=np.uint8)
        stack, at = self._stack, self._at
        stack[0], at[0] = root, 0
        args = (trie.nodes.ctypes.data, trie.n_nodes, trie.sink, stack.ctypes.data, at.ctypes.data, out.ctypes.data)
        fn = self.lib.cfg_table_walk
        while True:
            code = fn(*tab.addr, *args)
            if code == 0:
                break
            i = int(at[0])
            d = lists[1][i]
            if code == 1:
                self._derive(int(stack[d - 1]), lists[0][i], hist, trie, i, d)
            elif code == 3 and tab.lives[stack[d]] != IN_PYTHON:
                self._liveness(int(stack[d]), hist, trie, i, d)
            else:  # PYTHON: the subtree below node i, from the (concrete) state above it
                prefix = _path(trie, i)[:-1]
                parent = _replay(eng.machine, state, hist, prefix)
                hits = eng._walk_hits(parent, hist, lists, trie.sink, i, lists[2][i], prefix)
                if hits:
                    out[hits] = 1
                at[0] = lists[2][i]
        got = out.view(np.bool_)  # (the C walk never writes the trie's sink slot)
        if len(trie.dup_tok):
            got[trie.dup_tok] = got[trie.dup_src]
        return got

    def _derive(self, s: int, b: int, hist: bytes, trie, i: int, d: int) -> None:
        tab = self.table
        st = tab.states[s]
        if b == 0x22 and self._json and _has_free(st):  # the quote closing a string whose text was abstracted
            tab.trans[s * 256 + b] = PYTHON
            return
        try:
            nxt = self.engine.machine.advance(st, b, len(hist) + d - 1, _no_ctx)
        except _NeedsText:  # a captured value completes: its check reads the text
            tab.trans[s * 256 + b] = PYTHON
            return
        t = tab.intern(self._canon(nxt)) if nxt else DEAD
        tab.trans[s * 256 + b] = t

    def _liveness(self, t: int, hist: bytes, trie, i: int, d: int) -> None:
        tab = self.table
        path = bytearray(d + 1)
        try:
            lives = self.engine._lives(tab.states[t], len(hist) + d, _no_ctx, path, d)
        except _NeedsText:  # the lookahead completes a captured value: per node, in Python
            tab.lives[t] = IN_PYTHON
            return
        tab.lives[t] = 1 if lives else 2


def _replay(machine, state: tuple, hist: bytes, prefix: bytes) -> tuple:
    """The concrete state after `prefix` from `state` (table states are canonical)."""
    ctx = _ctx(hist, prefix)
    for k, b in enumerate(prefix):
        state = machine.advance(state, b, len(hist) + k, ctx)
    return state


class _NeedsText(Exception):
    """A table derivation read the output text: the result is not a function of the state."""


def _no_ctx(start: int, end: int) -> bytes:
    raise _NeedsText


def _path(trie, i: int) -> bytes:
    """The bytes from the trie's root to node i."""
    out = []
    while i >= 0:
        out.append(int(trie.byte[i]))
        i = int(trie.parent[i])
    return bytes(reversed(out))


def _ctx(hist: bytes, path):
    """Output bytes [start, end): committed output, then the walked path (read at call time,
    so the lookahead byte `_lives` writes into `path` is seen)."""
    base = len(hist)

    def ctx(start: int, end: int) -> bytes:
        if end <= base:
            return hist[start:end]
        tail = bytes(path[:end - base])
        return (hist[start:] + tail) if start < base else tail[start - base:]
    return ctx
