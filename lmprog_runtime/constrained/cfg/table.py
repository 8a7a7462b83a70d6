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
from lmprog_runtime.constrained.cfg.keycloses import KeyCloses
from lmprog_runtime.constrained.cfg.machine import _NUM, Machine
from lmprog_runtime.constrained.cfg.strings import FREE

UNKNOWN, DEAD, PYTHON = -1, -2, -3  # table_walk.c's transition markers
IN_PYTHON = 3  # liveness that reads the output text (table_walk.c stops there: a Python subtree)
SOFT_STATES = 4096
HARD_STATES = 16384
_SOURCE = pathlib.Path(__file__).with_name("table_walk.c")


def _declare(lib: ctypes.CDLL) -> None:
    ptr, i32 = ctypes.c_void_p, ctypes.c_int32
    lib.cfg_table_walk.argtypes = [ptr, ptr, ptr, i32, i32, ptr, ptr, ptr, ptr, ptr]
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
        node, count, utf, text = top[1], top[2], top[3], top[7]
        if node.enum is not None:
            continue
        if node.max_len is None and count > node.min_len:
            count = node.min_len
        if text is not None:
            text = FREE
        if utf and not top[6] and utf[1:5:3] != (0, b""):  # the partial character's bits are read
            utf = (utf[0], 0, utf[2], utf[3], b"")  # only by patterns and enums (and text: FREE)
        if count != top[2] or text is not top[7] or utf is not top[3]:
            out = list(state) if out is None else out
            out[k] = ((top[0], node, count, utf) + top[4:7] + (text,), st[1])
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


_ALL = np.ones(256, dtype=np.bool_)
_NONE = np.zeros(256, dtype=np.bool_)
_QUOTE = _NONE.copy()
_QUOTE[0x22] = True
_NUM_EXITS = [~np.isin(np.arange(256), list(d)) for d in _NUM]
_EXITS = ("S", "N", "L")  # lexemes: frames whose steps touch the stack below only at their end


def _exits(top) -> np.ndarray:
    """bool [256]: the bytes on which lexeme frame `top` may end (and read the stack below):
    a string's closing quote (outside an escape or a UTF-8 sequence), a number's first
    non-number byte, any byte at a literal's last character."""
    kind = top[0]
    if kind == "S":
        return _NONE if top[3] or top[4] else _QUOTE
    if kind == "N":
        return _NUM_EXITS[top[3]]
    return _ALL if top[2] + 1 == len(top[1]) else _NONE


class StateTable:
    """Interned pure states of one grammar, their transitions and liveness."""

    def __init__(self, machine, lexemes: bool):
        """lexemes: share rows between states in the same lexeme (JSON machines only)."""
        self.machine, self.lexemes = machine, lexemes
        self._rows: dict = {}  # candidates frozenset -> its initial table row
        self.keys = KeyCloses()
        self.reset()

    def reset(self) -> None:
        self.lex: dict = {}  # a lexeme's top frame -> the first state id interned with it
        self.closes: dict = {}  # (state id inside a key, key text) -> the id after its closing quote
        # (mirrored into self.keys for the C walk)
        self.ids: dict = {}
        self.states: list = []
        self.trans = np.full(64 * 256, UNKNOWN, dtype=np.int32)
        self.lives = np.zeros(64, dtype=np.uint8)
        self.inside = np.zeros(64, dtype=np.uint8)  # 1: inside a key with FREE text, plain mode
        self.addr = (self.trans.ctypes.data, self.lives.ctypes.data)
        self.keys.clear()
        self.keys.set_inside(self.inside)

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
            self.inside = np.concatenate([self.inside, np.zeros(n, dtype=np.uint8)])
            self.addr = (self.trans.ctypes.data, self.lives.ctypes.data)
            self.keys.set_inside(self.inside)
        self.ids[state] = n
        self.states.append(state)
        cands = self.machine.candidates(state)
        if cands is None:
            self.lives[n] = 1  # (MaskEngine._lives: a state taking any byte lets a token end)
        else:
            cands = frozenset(cands)
            row = self._rows.get(cands)
            if row is None:
                row = self._rows[cands] = np.full(256, DEAD, dtype=np.int32)
                row[list(cands)] = UNKNOWN
            self.trans[n * 256:(n + 1) * 256] = row
        if self.lexemes and len(state) == 1 and state[0][0][0] in _EXITS:
            top = state[0][0]
            self.lex.setdefault(top, n)  # (most states are never stepped from: shared lazily)
            if top[0] == "S" and top[7] is FREE and not (top[3] or top[4] or top[5]):
                self.inside[n] = 1
        return n

    def inside_step(self, s: int, b: int) -> Optional[int]:
        """The transition of state s on byte b read off another state of its lexeme, when b
        stays inside the lexeme (it does not read what lies below) and that one knows it."""
        state = self.states[s]
        if not self.lexemes or len(state) != 1:
            return None
        top = state[0][0]
        rep = self.lex.get(top)
        if rep is None or rep == s or _exits(top)[b]:
            return None
        t = int(self.trans[rep * 256 + b])
        if t == UNKNOWN:  # derived on the lexeme's first state, for every later one to share
            nxt = self.machine.advance(self.states[rep], b, 0, _no_ctx)
            t = self.trans[rep * 256 + b] = self.intern(canonical(nxt)) if nxt else DEAD
        if t < 0:
            return t if t == DEAD else None
        return self.intern(((self.states[t][0][0], state[0][1]),))


class TableWalker:
    """The C walk of one grammar's masks (`walk`), falling back to the engine's Python walk
    for subtrees whose states capture output."""

    def __init__(self, engine, lib: ctypes.CDLL):
        self.engine, self.lib = engine, lib
        # JSON / regex states are canonicalized; EBNF states (ebnf.py) are pure as they are
        self._json = isinstance(engine.machine, Machine)
        self.table = StateTable(engine.machine, self._json)
        self._canon = canonical if self._json else (lambda state: state)
        self._stack = np.zeros(257, dtype=np.int32)
        self._at = np.zeros(1, dtype=np.int32)
        self._path = np.zeros(258, dtype=np.uint8)  # the C walk's current path

    def walk(self, state: tuple, hist: bytes, trie, lists) -> np.ndarray:
        """bool [n_slots]: the tokens of `trie` allowed from `state` (the Python walk's result)."""
        eng, tab = self.engine, self.table
        if len(tab.states) > SOFT_STATES or len(tab.closes) > 4 * SOFT_STATES:
            tab.reset()
        root = tab.intern(self._canon(state))
        if root == PYTHON:
            return eng._walk_py(state, hist, trie, lists)
        out = np.zeros(eng.vocab.n_slots, dtype=np.uint8)
        stack, at = self._stack, self._at
        stack[0], at[0] = root, 0
        tab.keys.set_head(_root_key(state) if self._json else None)
        args = (trie.nodes.ctypes.data, trie.n_nodes, trie.sink, stack.ctypes.data, at.ctypes.data, out.ctypes.data,
                ctypes.addressof(tab.keys.struct), self._path.ctypes.data)
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
            else:  # node i's step (code 2) or its token's liveness (3) reads the output text
                at[0] = self._concrete(state, hist, trie, lists, i, d, code == 2, out)
        got = out.view(np.bool_)  # (the C walk never writes the trie's sink slot)
        if len(trie.dup_tok):
            got[trie.dup_tok] = got[trie.dup_src]
        return got

    def _concrete(self, root: tuple, hist: bytes, trie, lists, i: int, d: int, step: bool, out) -> int:
        """Node i from the concrete state (replayed from the walk's root along the path):
        its step if `step`, its token's liveness; returns the node the C walk resumes at
        (its subtree continues in C from the canonical state reached)."""
        eng, tab = self.engine, self.table
        path = bytearray(_path(trie, i)) + b"\x00"
        ctx = _ctx(hist, path)
        t = self._key_close(root, hist, trie, path, i, d) if step and self._json else None
        if t == DEAD:
            return lists[2][i]
        state = None
        if t is not None and t >= 0 and (tab.lives[t] in (1, 2) or lists[3][i] == trie.sink):
            state = tab.states[t]  # canonical: only its id and its table liveness are read
        else:
            state = _replay(eng.machine, root, hist, bytes(path[:d]), ctx)
            if not state:
                return lists[2][i]
        if step:
            t = tab.intern(self._canon(state)) if t is None or t < 0 else t
            if t == PYTHON:  # the table is full: the whole subtree in Python
                return self._python_subtree(root, hist, lists, trie, i, bytes(path[:d - 1]), out)
            self._stack[d] = t
        tok = lists[3][i]
        if tok != trie.sink:
            lives = tab.lives[t] if t is not None and tab.lives[t] in (1, 2) else None
            if lives is None:
                lives = 1 if eng._lives(state, len(hist) + d, ctx, path, d) else 2
            if lives == 1:
                out[tok] = 1
        return i + 1

    def _key_close(self, root: tuple, hist: bytes, trie, path: bytearray, i: int, d: int) -> Optional[int]:
        """The table id after node i when it is the quote closing a key whose text the path
        spells (memoized per state and text, its liveness derived), DEAD, or None (replay)."""
        tab = self.table
        p = int(self._stack[d - 1])
        parent = _key_parent(root, tab.states[p], path, d)
        if parent is None:
            return None
        key = (p, parent[0][0][7])
        t = tab.closes.get(key)
        if t is None:
            got = self.engine.machine.advance(parent, 0x22, len(hist) + d - 1, _ctx(hist, path))
            t = tab.closes[key] = tab.intern(self._canon(got)) if got else DEAD
            if t != PYTHON:
                tab.keys.add(p, key[1].encode("utf-8"), t)
        if t >= 0 and tab.lives[t] == 0:
            self._liveness(t, hist, trie, i, d)
        return t

    def _python_subtree(self, root, hist, lists, trie, i: int, prefix: bytes, out) -> int:
        parent = _replay(self.engine.machine, root, hist, prefix, _ctx(hist, prefix))
        hits = self.engine._walk_hits(parent, hist, lists, trie.sink, i, lists[2][i], prefix)
        if hits:
            out[hits] = 1
        return lists[2][i]

    def _derive(self, s: int, b: int, hist: bytes, trie, i: int, d: int) -> None:
        tab = self.table
        st = tab.states[s]
        if b == 0x22 and self._json and _has_free(st):  # the quote closing a string whose text was abstracted
            tab.trans[s * 256 + b] = PYTHON
            return
        got = tab.inside_step(s, b)
        if got is not None:
            tab.trans[s * 256 + b] = got
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


def _root_key(root: tuple) -> Optional[bytes]:
    """The text (UTF-8) of the key the walk's root is inside, when it is in plain mode."""
    top = root[0][0] if len(root) == 1 and root[0] is not None else None
    if top is None or top[0] != "S" or type(top[7]) is not str or top[1].enum is not None or top[3] or top[4] or top[5]:
        return None
    return top[7].encode("utf-8")


def _key_parent(root: tuple, canon: tuple, path: bytearray, d: int) -> Optional[tuple]:
    """The concrete state before node d-1 of `path` when it is inside a key string with
    FREE text (`canon`, its canonical form) and the key's text can be read off the path:
    that state with the text put back; None when it cannot be (escapes, a partial
    character, several stacks), then the caller replays the path."""
    if len(canon) != 1 or path[d - 1] != 0x22:
        return None
    top, rest = canon[0]
    if top[0] != "S" or top[7] is not FREE or top[3] or top[4] or top[5]:
        return None
    inside = bytes(path[:d - 1])
    if 0x5C in inside:
        return None
    q = inside.rfind(b'"')
    if q >= 0:  # the key opened on the path (no escape: its last quote opened it)
        head, inside = "", inside[q + 1:]
    else:  # it opened before the walk's root, which is inside it
        rtop = root[0][0] if len(root) == 1 else None
        if rtop is None or rtop[0] != "S" or type(rtop[7]) is not str or rtop[3] or rtop[4] or rtop[5]:
            return None
        head = rtop[7]
    try:
        text = head + inside.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return ((top[:7] + (text,), rest),)


def _replay(machine, state: tuple, hist: bytes, prefix: bytes, ctx) -> tuple:
    """The concrete state after `prefix` from `state` (table states are canonical); ()
    when it dies."""
    for k, b in enumerate(prefix):
        state = machine.advance(state, b, len(hist) + k, ctx)
        if not state:
            return ()
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
