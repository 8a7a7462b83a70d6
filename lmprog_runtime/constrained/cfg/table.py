"""Masks walked in C against a lazily filled transition table of interned matcher states.

A matcher state in canonical form (canonical.py: a key's text FREE, counts clamped where
only a bound reads them, capture offsets dropped) is, for every byte whose step does not
read the output text, a function of itself: byte b always leads to the same next state,
and whether a token may end in it (`MaskEngine._lives`' one byte of lookahead) is fixed.
States are interned (tuple -> int id) and their transitions kept in an int32 table
[states x 256], filled on demand: the C walk (table_walk.c) runs over the trie until it
meets a transition or a liveness not derived yet, returns to Python to derive it
(`Machine.advance`, once per state and byte), and resumes. Bytes outside
`Machine.candidates` are dead when a state is interned (in a string body, so are the
bytes it never takes there: `string_bytes`); a lexeme frame's inside steps
are read off the first state with the same frame (`StateTable.inside_step`; for plain
string bodies the C walk does it itself and makes the new state ids, lexrows.py). A step
that reads the text (a captured value's check, a key's closing quote) is PYTHON: that
node is stepped from the concrete state (replayed from the walk's root, or for a key,
the key text read off the path and the step registered in keycloses.py, which the C walk
probes next time) and the walk continues below it in C. The Python walk of mask.py is
the path where no C compiler exists and the tests' oracle. The table is per grammar and
outlives masks. Memory: 1 KB per state; past SOFT_STATES the table is emptied before the
next walk, past HARD_STATES a walk leaves new transitions to Python; all grammars' tables
together are bounded by table_budget.py (the least recently walked emptied first).
"""
from __future__ import annotations

import ctypes
import functools
import re
import threading
import weakref
from typing import Optional

import numpy as np

from lmprog_runtime import native
from lmprog_runtime.constrained.cfg.canonical import (EXITS, NeedsText, alike_bytes, canonical, class_exponent,
                                                      closes_free, exits, extra_key, free_number_exponent, key_parent,
                                                      root_escaped, root_key)
from lmprog_runtime.constrained.cfg.compiled import SOURCE_DIR
from lmprog_runtime.constrained.cfg.keycloses import KeyCloses
from lmprog_runtime.constrained.cfg.lexrows import (LexRows, States, StrContext, WsContext, string_shape, ws_lexeme,
                                                    ws_of)
from lmprog_runtime.constrained.cfg.machine import WS, Machine
from lmprog_runtime.constrained.cfg.strings import EXTRA, FREE
from lmprog_runtime.constrained.cfg.table_budget import BUDGET
from lmprog_runtime.constrained.cfg.untrack import untrack

UNKNOWN, DEAD, PYTHON = -1, -2, -3  # table_walk.c's transition markers
IN_PYTHON = 3  # liveness that reads the output text (table_walk.c stops there: a Python subtree)
SOFT_STATES = 4096
# a new table's room: a compile reserves 256 states after its warm-up anyway (backend.
# TABLE_LEAST), and each growth on the way there (copies, the lexeme map rebuilt) took ~0.25
# ms of a compile; an emptied table (table_budget.py, SOFT_STATES) keeps the least
FIRST_STATES = 256
EMPTIED_STATES = 64
HARD_STATES = 16384
_SOURCE = SOURCE_DIR / "table_walk.c"  # (not beside __file__: this module may be an extension elsewhere, compiled.py)
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # (a key's text that UTF-8 cannot spell raw)
_ROWS: dict = {}  # candidate bytes (frozenset) -> a new state's table row, shared by all grammars (read only)


def _declare(lib: ctypes.CDLL) -> None:
    ptr, i32 = ctypes.c_void_p, ctypes.c_int32
    lib.cfg_table_walk.argtypes = [ptr, ptr, ptr, i32, i32, ptr, ptr, ptr, ptr, ptr, ptr, ptr]
    lib.cfg_table_walk.restype = i32
    lib.cfg_class_walk.argtypes = [ptr, ptr, ptr, i32, i32, ptr, ptr, i32, ctypes.c_int64, ctypes.c_int64, ptr, ptr,
                                    ptr, i32]
    lib.cfg_class_walk.restype = i32


_KERNEL = native.Kernel(_SOURCE, ("-O2",), False, _declare)


def c_table_walker() -> Optional[ctypes.CDLL]:
    """The C walk, built once per source version; None where it cannot be built."""
    return _KERNEL.lib()


class StateTable:
    """Interned pure states of one grammar, their transitions and liveness."""

    def __init__(self, machine, lexemes: bool):
        """lexemes: share rows between states in the same lexeme (JSON machines only)."""
        self.machine, self.lexemes = machine, lexemes
        self.canon = canonical  # (TableWalker sets its own: the vocabulary's)
        self.keys = KeyCloses()
        self.lexrows = LexRows()
        self.lock = threading.Lock()  # held while a walk uses the table (TableWalker sets the engine's)
        self._held = [0]  # bytes reported to BUDGET (given back when the table is collected)
        weakref.finalize(self, _give_back, self._held, BUDGET)
        self.reset(FIRST_STATES)
        BUDGET.track(self)

    def reset(self, cap: int = EMPTIED_STATES) -> None:
        self.lex: dict = {}  # a lexeme's top frame -> the first state id interned with it
        self.wsrep: dict = {}  # a whitespace state -> the first state id interned with it
        self.ws_kinds: dict = {}  # a whitespace state -> its lexeme kind (lexrows.ws_lexeme)
        self.srep: dict = {}  # a plain string body's frame less its node -> its first state id
        self.closes: dict = {}  # (state id inside a key, key text) -> the id after its closing quote
        self.in_c: set = set()  # the closes registered in self.keys (those met twice)
        self.ids: dict = {}
        self.states = States(self)  # (ids the C walk made are built on first read)
        self.trans = np.full(cap * 256, UNKNOWN, dtype=np.int32)
        self.lives = np.zeros(cap, dtype=np.uint8)
        self.inside = np.zeros(cap, dtype=np.uint8)  # 1: inside a key with FREE text, plain mode
        self.generic = np.full(cap, UNKNOWN, dtype=np.int32)  # the close of an additionalProperties key
        self.addr = (self.trans.ctypes.data, self.lives.ctypes.data)
        self.keys.clear()
        self.keys.set_inside(self.inside, self.generic)
        self.lexrows.clear(cap)
        self.lexrows.grow(cap, self.inside, self.lives, HARD_STATES)
        self.account()

    def account(self) -> None:
        """Report the table's bytes (its arrays and key closes) to the process-wide budget."""
        n = (self.trans.nbytes + self.lives.nbytes + self.inside.nbytes + self.generic.nbytes
             + self.keys.table.nbytes + self.keys.pool.nbytes + self.lexrows.nbytes())
        if n != self._held[0]:  # (a walk mostly finds it unchanged: the budget's lock not taken)
            BUDGET.resize(n - self._held[0])
            self._held[0] = n

    def intern(self, state: tuple) -> int:
        """The id of a pure state (interned on first sight, dead bytes filled in);
        PYTHON when the table is full."""
        got = self.ids.get(state)
        if got is not None:
            return got
        lexeme = self._string_lexeme(state)
        ws = ws_lexeme(self.machine.pool, state, self.ws_kinds) if self.lexemes and not lexeme else None
        if lexeme:  # a string state the C walk may have made
            rep = self.srep.get(string_shape(state[0][0]))
            got = self.lexrows.find(rep, StrContext.of(state[0])) if rep is not None else -1
            if got >= 0:
                self.ids[state] = got
                return got
        elif ws is not None:  # whitespace the C walk may have made
            rep = self.wsrep.get(ws[1])
            got = self.lexrows.find(rep, ws[2]) if rep is not None else -1
            if got >= 0:
                self.ids[state] = got
                return got
        n = int(self.lexrows.n[0])
        if n >= HARD_STATES:
            return PYTHON
        if n == len(self.lives):
            self._grow(2 * n)
        self.ids[state] = n
        self.states.sync(n)
        self.states.append(state)
        untrack(state)  # (kept for the table's life: out of the collector's view, untrack.py)
        self.lexrows.n[0] = n + 1
        cands = self.machine.candidates(state)
        if cands is None:
            self.lives[n] = 1  # (MaskEngine._lives: a state taking any byte lets a token end)
            cands = self.machine.string_bytes(state) if self.lexemes else None
        elif (self.lexemes and len(state) == 1 and state[0] is not None and state[0][0][0] == "L"
              and state[0][0][2] + 1 < len(state[0][0][1])):
            self.lives[n] = 1  # (inside a literal, short of its last byte: its next byte steps it)
        if cands is not None:
            cands = frozenset(cands)
            row = _ROWS.get(cands)
            if row is None:
                if len(_ROWS) >= 4096:
                    _ROWS.clear()
                row = np.full(256, DEAD, dtype=np.int32)
                row[list(cands)] = UNKNOWN
                _ROWS[cands] = row  # (complete before another grammar's thread can read it)
            self.trans[n * 256:(n + 1) * 256] = row
        if self.lexemes and len(state) == 1 and state[0][0][0] in EXITS:
            top = state[0][0]
            self.lex.setdefault(top, n)  # (most states are never stepped from: shared lazily)
            if top[0] == "S" and top[7] is FREE and not (top[3] or top[4] or top[5]):
                self.inside[n] = 1
            if lexeme:
                self.lexrows.register(n, self.srep.setdefault(string_shape(top), n), StrContext.of(state[0]), lexeme)
        elif ws is not None:
            first = ws[1] not in self.wsrep
            self.lexrows.register(n, self.wsrep.setdefault(ws[1], n), ws[2], ws[0])
            if ws[0] == 3:
                self.lives[n] = 1  # (MaskEngine._lives: a ws byte follows)
            if first:  # every context's ws steps are read off this state's: derived now, not at walk stops
                self._ws_steps(n, state[0])
        return n

    def reserve(self, states: int) -> None:
        """Room for `states` states at least (the capacity doubled until it holds them):
        growing copies every array, a pause better paid at compile time than in a mask."""
        cap = len(self.lives)
        while cap < min(states, HARD_STATES):
            cap *= 2
        if cap > len(self.lives):
            self._grow(cap)

    def _grow(self, cap: int) -> None:
        n = len(self.lives)
        self.trans = np.concatenate([self.trans, np.full((cap - n) * 256, UNKNOWN, dtype=np.int32)])
        self.lives = np.concatenate([self.lives, np.zeros(cap - n, dtype=np.uint8)])
        self.inside = np.concatenate([self.inside, np.zeros(cap - n, dtype=np.uint8)])
        self.generic = np.concatenate([self.generic, np.full(cap - n, UNKNOWN, dtype=np.int32)])
        self.addr = (self.trans.ctypes.data, self.lives.ctypes.data)
        self.keys.set_inside(self.inside, self.generic)
        self.lexrows.grow(cap, self.inside, self.lives, HARD_STATES)
        self.account()

    def _ws_steps(self, n: int, st) -> None:
        """Whitespace state n's steps on the ws bytes (Machine.step of a V / O / A frame on
        one: the same frame with its whitespace state stepped, or nothing)."""
        pool, ctx = self.machine.pool, WsContext.of(st)
        ws = ws_of(st[0])
        made: dict = {}  # whitespace state -> id (the ws bytes mostly step alike)
        for b in WS:
            if self.trans[n * 256 + b] == UNKNOWN:
                got = pool.step(ws, b)
                t = made.get(got)
                if t is None:
                    t = made[got] = self.intern((ctx.state(got),)) if got != pool.NONE else DEAD
                self.trans[n * 256 + b] = t

    def _string_lexeme(self, state: tuple) -> int:
        """table_walk.c's kind of a state: 1 a plain string body (no enum: any byte may come)
        whose quote ends it, 2 one inside an escape or a UTF-8 sequence, 0 anything else."""
        if not self.lexemes or len(state) != 1 or state[0] is None:
            return 0
        top = state[0][0]
        if type(top) is not tuple or top[0] != "S" or top[1].enum is not None:
            return 0
        return 2 if top[3] or top[4] else 1

    def set_generic(self, p: int, parent: tuple, t: int) -> None:
        """When key state p's close `t` (from concrete `parent`) is that of a key of
        additionalProperties, make it p's close for every key text but the registered ones:
        the declared properties, the keys already seen and, under maxProperties, those with
        dependentRequired keys (their close reads the keys seen: UNKNOWN, Python derives them)."""
        rest = parent[0][1]
        obj, key = rest[0], parent[0][0][7]
        node, seen = obj[1], obj[3]
        if obj[0] != "O" or node.key_node is None or node.key_node.residual is not None:
            return  # (a propertyNames check reads the key's text at its close)
        after = self.states[t][0][0]
        if not extra_key(node, key) or key in seen or after[0] != "O" or after[4] is not EXTRA:
            return
        for k in set(node.props) | seen | (set(node.dep_required) if node.max_props is not None else set()):
            if (p, k) not in self.in_c and not _LONE_SURROGATE.search(k):  # (those are registered with their own
                self.keys.add(p, k.encode("utf-8"), UNKNOWN)                # close; a lone surrogate: never on a path)
        self.generic[p] = t

    def inside_step(self, s: int, b: int) -> Optional[int]:
        """The transition of state s on byte b read off another state of its lexeme, when b
        stays inside the lexeme (it does not read what lies below) and that one knows it."""
        state = self.states[s]
        if not self.lexemes or len(state) != 1:
            return None
        top = state[0][0]
        rep = self.lex.get(top)
        if rep is None or rep == s or exits(top)[b]:
            return None
        t = int(self.trans[rep * 256 + b])
        if t == UNKNOWN:  # derived on the lexeme's first state, for every later one to share
            nxt = self.machine.advance(self.states[rep], b, 0, _no_ctx)
            t = self.trans[rep * 256 + b] = self.intern(self.canon(nxt)) if nxt else DEAD
        if t < 0:
            return t if t == DEAD else None
        nxt = self.states[t]
        if len(nxt) != 1 or nxt[0][1] != self.states[rep][0][1]:
            return None  # (not a step inside the lexeme after all: derived on its own)
        return self.intern(((nxt[0][0], state[0][1]),))


class TableWalker:
    """The C walk of one grammar's masks (`walk`), falling back to the engine's Python walk
    for subtrees whose states capture output."""

    def __init__(self, engine, lib: ctypes.CDLL):
        self.engine, self.lib = engine, lib
        # JSON / regex states are canonicalized; EBNF states (ebnf.py) are pure as they are
        self._json = isinstance(engine.machine, Machine)
        self.table = StateTable(engine.machine, self._json)
        self.table.lock = engine._walk_lock  # (the engine holds it around `walk`)
        if self._json:  # (an integer past its minimum is free; any number's where tokens write no exponent digits)
            self._canon = functools.partial(canonical, exponent_free=engine.vocab.exponent_free)
        else:
            self._canon = lambda state: state
        self.table.canon = self._canon
        self._stack = np.zeros(257, dtype=np.int32)
        self._at = np.zeros(1, dtype=np.int32)
        self._path = np.zeros(258, dtype=np.uint8)  # the C walk's current path
        self._pend = np.zeros(258, dtype=np.int32)  # bytes to derive at a stop (count first)
        self._args: dict = {}  # id(trie) -> (trie, the C walk's fixed arguments before `out`, after it)
        self._out = np.zeros(engine.vocab.n_slots, dtype=np.uint8)  # the row a walk writes
        self._out_addr = self._out.ctypes.data  # (read once: `.ctypes` makes an object per read)
        self._replays: dict = {}  # this walk's concrete states by path (_replayed)
        self._bound: dict = {}  # this walk's PYTHON steps bound to their state (_bind): (state, byte) -> id
        self._binds = False  # whether this walk binds steps (_bind: a JSON state of one stack)
        # False after a walk that read neither the output text nor a concrete state: its
        # mask is then that of the canonical root, whatever the text (MaskEngine memo)
        self.read_text = True

    def walk(self, state: tuple, hist: bytes, trie, lists) -> np.ndarray:
        """bool [n_slots]: the tokens of `trie` allowed from `state` (the Python walk's result);
        the walker's own row, valid until its next walk (the engine's walk lock held)."""
        eng, tab = self.engine, self.table
        if len(tab.states) > SOFT_STATES or len(tab.closes) > 4 * SOFT_STATES:
            tab.reset()
        tab.account()
        BUDGET.before_walk(tab)
        self.read_text = True
        canon = self._canon(state)
        root = tab.intern(canon)
        if root == PYTHON:
            return eng._walk_py(state, hist, trie, lists)
        self.read_text = root_key(state) is not None  # (the C walk reads a key's text at its closes)
        out = self._out  # (one row per walker, cleared: the engine packs it before the next walk)
        out.fill(0)
        self._replays.clear()
        self._binds = self._json and len(canon) == 1 and canon[0] is not None
        self._stack[0] = root
        try:
            self._run(state, hist, trie, lists)
        finally:
            if self._bound:  # (the next walk's root may fix them otherwise: PYTHON again)
                for s, b in self._bound:
                    tab.trans[s * 256 + b] = PYTHON
                self._bound.clear()
        return self._tokens(out, trie)

    @staticmethod
    def _tokens(out: np.ndarray, trie) -> np.ndarray:
        got = out.view(np.bool_)  # (the C walk never writes the trie's sink slot)
        if len(trie.dup_tok):
            got[trie.dup_tok] = got[trie.dup_src]
        return got

    def _run(self, state: tuple, hist: bytes, trie, lists) -> None:
        """The C walk over the trie from stack[0], Python at its stops, into the walker's row."""
        tab, out = self.table, self._out
        stack, at = self._stack, self._at
        at[0] = 0
        tab.keys.set_head(root_key(state) if self._json else None, self._json and root_escaped(state))
        fixed = self._args.get(id(trie))  # (the trie's and this walker's buffers: their addresses, made once)
        if fixed is None or fixed[0] is not trie:
            fixed = self._args[id(trie)] = (trie, (trie.nodes.ctypes.data, trie.n_nodes, trie.sink, stack.ctypes.data,
                                                   at.ctypes.data), (ctypes.addressof(tab.keys.struct),
                                                   self._path.ctypes.data, ctypes.addressof(tab.lexrows.struct),
                                                   self._pend.ctypes.data))
        args = fixed[1] + (self._out_addr,) + fixed[2]
        fn, count = self.lib.cfg_table_walk, tab.lexrows.n
        while True:
            code = fn(*tab.addr, *args)
            tab.states.sync(int(count[0]))
            if code == 0:
                break
            i = int(at[0])
            d = lists[1][i]
            if code == 1:  # node i and its later siblings C cannot read off a rep: one stop
                s, pend = int(stack[d - 1]), self._pend
                for b in pend[1:1 + pend[0]].tolist():
                    if tab.trans[s * 256 + b] == UNKNOWN:
                        self._derive(s, b, hist, trie, i, d)
            elif code == 3 and tab.lives[stack[d]] != IN_PYTHON:
                self._liveness(int(stack[d]), hist, trie, i, d)
            else:  # node i's step (code 2) or its token's liveness (3) reads the output text
                at[0] = self._concrete(state, hist, trie, lists, i, d, code == 2, out)

    def _concrete(self, root: tuple, hist: bytes, trie, lists, i: int, d: int, step: bool, out) -> int:
        """Node i from the concrete state (replayed from the walk's root along the path):
        its step if `step`, its token's liveness; returns the node the C walk resumes at
        (its subtree continues in C from the canonical state reached)."""
        eng, tab = self.engine, self.table
        b = int(self._path[d - 1])
        if not (step and b in (0x45, 0x65) and self._class_exponent(d)):
            self.read_text = True
        path = bytearray(self._path[:d].tobytes()) + b"\x00"  # (the C walk wrote the path to node i)
        text, reads = _ctx(hist, path), []

        def ctx(start: int, end: int) -> bytes:  # (a step that reads the text is not bound: _bind)
            reads.append(start)
            return text(start, end)
        t = self._key_close(root, hist, trie, path, i, d) if step and b == 0x22 and self._json else None
        if t == DEAD:
            return lists[2][i]
        state = None
        if t is not None and t >= 0 and (tab.lives[t] in (1, 2) or lists[3][i] == trie.sink):
            state = tab.states[t]  # canonical: only its id and its table liveness are read
        else:
            state = self._replayed(root, hist, bytes(path[:d]), ctx)
            if not state:
                if step and t is None and not reads:
                    self._bind(int(self._stack[d - 1]), b, DEAD, path, d)
                return lists[2][i]
        if step:
            if t is None or t < 0:
                t = tab.intern(self._canon(state))
                if t != PYTHON and not reads:
                    self._bind(int(self._stack[d - 1]), b, t, path, d)
            if t == PYTHON:  # the table is full: the whole subtree in Python
                return self._python_subtree(root, hist, lists, trie, i, bytes(path[:d - 1]), out)
            self._stack[d] = t
        tok = lists[3][i]
        if tok != trie.sink:
            if t is not None and tab.lives[t] == 0:
                self._liveness(t, hist, trie, i, d)
            lives = tab.lives[t] if t is not None and tab.lives[t] in (1, 2) else None
            if lives is None:
                lives = 1 if eng._lives(state, len(hist) + d, ctx, path, d) else 2
            if lives == 1:
                out[tok] = 1
        return i + 1

    def _replayed(self, root: tuple, hist: bytes, prefix: bytes, ctx) -> tuple:
        """`_replay` of `prefix` from the walk's root, resumed from the longest prefix of it
        this walk replayed before (the trie walk meets a subtree's concrete steps in order:
        `{}`, `{}}`, `{}},` ... share their first bytes' states); () when it dies."""
        memo = self._replays
        got = memo.get(prefix)
        if got is not None:
            return got
        k = len(prefix) - 1
        while k > 0 and prefix[:k] not in memo:
            k -= 1
        state = memo[prefix[:k]] if k > 0 else root
        machine, base = self.engine.machine, len(hist)
        for j in range(k, len(prefix)):
            state = machine.advance(state, prefix[j], base + j, ctx) if state else ()
            memo[prefix[:j + 1]] = state
        return state

    def _bind(self, p: int, b: int, t: int, path: bytearray, d: int) -> None:
        """Step (p, b), PYTHON in the table, taken as `t` (an id or DEAD) for the rest of this
        walk where nothing its concrete step read can differ along another path to p: the
        steps of a value ending in an object member whose key is abstracted (EXTRA: Machine.
        finish reads the key, which only the concrete state holds) when no member's value
        began on the path (no colon before b), so that every such member in p is one the
        walk root is inside, its key the root's. (A token that ends the root's member and
        opens another object's, `1},{"b":2,`, can reach a state equal to the root member's,
        the array's count clamped, with another key: tests/runtime/test_cfg_mask_table.py.)
        The step read no output text (a check completing, or a uniqueItems item compared
        with those seen: the caller's `reads`), and the byte is neither a key's closing quote
        nor a number's exponent (their steps read the abstracted key text, mantissa): so the
        concrete states along different paths to p differ only in what none of their steps
        on b reads (a pending check's start offset, a uniqueItems array's items seen, a
        count, a free number's digits), and the step is the same from each. A walk meeting
        p and b again (`1,` `2,` `true,` ... after such a key) then stays in C; the table
        is PYTHON there again after the walk (`walk`: the next root's keys may differ)."""
        if not self._binds or (p, b) in self._bound or 0x3A in path[:d - 1]:
            return
        st = self.table.states[p]
        if len(st) != 1 or st[0] is None or self._replays.get(bytes(path[:d - 1])) == ():
            return
        top = st[0][0]
        if (b == 0x22 and (top[0] != "S" or top[7] is not None)) or (b in (0x45, 0x65) and top[0] == "N"):
            return  # (a quote: only a value string's close, not a key's; no number's exponent)
        self._bound[(p, b)] = t
        self.table.trans[p * 256 + b] = t

    def _class_exponent(self, d: int) -> bool:
        """Node d's step is the `e` of a bounded number whose text stands for its class
        (canonical.class_exponent): stepped from the concrete state, the mask below it is
        that of every text of the class."""
        if not self._json:
            return False
        b, v = int(self._path[d - 1]), self.engine.vocab
        st = self.table.states[int(self._stack[d - 1])]
        return class_exponent(st, b, v.exponent_free)

    def _key_close(self, root: tuple, hist: bytes, trie, path: bytearray, i: int, d: int) -> Optional[int]:
        """The table id after node i when it is the quote closing a key whose text the path
        spells (memoized per state and text, its liveness derived), DEAD, or None (replay)."""
        tab = self.table
        p = int(self._stack[d - 1])
        parent = key_parent(root, tab.states[p], path, d)
        if parent is None:
            return None
        key = (p, parent[0][0][7])
        t = tab.closes.get(key)
        if t is None:
            got = self.engine.machine.advance(parent, 0x22, len(hist) + d - 1, _ctx(hist, path))
            t = tab.closes[key] = tab.intern(self._canon(got)) if got else DEAD
            if t >= 0 and tab.generic[p] == UNKNOWN:
                tab.set_generic(p, parent, t)
        elif t != PYTHON and key not in tab.in_c:  # met again: from now on the C walk finds it
            tab.in_c.add(key)
            if not _LONE_SURROGATE.search(key[1]):  # (a key spelled only with an escape: never on a path)
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
        """trans[s, b] derived, and those of the bytes that step s alike (canonical.py
        alike_bytes) filled from it."""
        self._derive_byte(s, b, hist, trie, i, d)
        alike = alike_bytes(self.table.states[s], b) if self._json else None
        if alike is not None:
            row = self.table.trans[s * 256:(s + 1) * 256]
            row[alike[row[alike] == UNKNOWN]] = row[b]

    def _derive_byte(self, s: int, b: int, hist: bytes, trie, i: int, d: int) -> None:
        tab = self.table
        st = tab.states[s]
        v = self.engine.vocab
        if self._json and ((b == 0x22 and closes_free(st)) or (free_number_exponent(st, b) and v.max_digits >= 17)
                           or class_exponent(st, b, v.exponent_free)):
            tab.trans[s * 256 + b] = PYTHON  # (a string's text or a number's digits were abstracted)
            return
        # (a free number's `e` is stepped from its text "0": a number's text is then read only
        # by number_ok's exponent overflow, 18 or more exponent digits, more than a walk can
        # add here, the digits in a row of any token, and by MAX_NUMBER_CHARS, out of reach of
        # a free mantissa within one walk: canonical._free_number; an exponent state keeps its
        # text, so a walk rooted in one steps its own)
        got = tab.inside_step(s, b)
        if got is not None:
            tab.trans[s * 256 + b] = got
            return
        r = tab.lexrows.ws_source(s, b)
        if r is not None:  # derived on the first state that C reads it off (then shared)
            if tab.trans[r * 256 + b] == UNKNOWN:
                self._derive(r, b, hist, trie, i, d)
            if b not in WS:  # (a non-ws byte does not read the whitespace state: the context's row)
                tab.trans[s * 256 + b] = tab.trans[r * 256 + b]
                return
        try:
            nxt = self.engine.machine.advance(st, b, len(hist) + d - 1, _no_ctx)
        except NeedsText:  # a captured value completes: its check reads the text
            tab.trans[s * 256 + b] = PYTHON
            return
        t = tab.intern(self._canon(nxt)) if nxt else DEAD
        tab.trans[s * 256 + b] = t

    def _liveness(self, t: int, hist: bytes, trie, i: int, d: int) -> None:
        """MaskEngine._lives of state t without the output text: a lookahead byte that
        completes a captured value (its check reads the text) is tried last, so only a
        state that no other byte continues is IN_PYTHON (decided per node)."""
        tab, m = self.table, self.engine.machine
        state, pos = tab.states[t], len(hist) + d
        cands = m.candidates(state)
        if cands is None or m.complete(state):
            tab.lives[t] = 1
            return
        needs = False
        for c in (None, *cands):
            try:
                if m.accepting(state, pos, _no_ctx) if c is None else m.advance(state, c, pos, _no_ctx):
                    tab.lives[t] = 1
                    return
            except NeedsText:
                needs = True
        tab.lives[t] = IN_PYTHON if needs else 2


def _give_back(held: list, budget) -> None:
    budget.give_back(held[0])  # (never a lock: table_budget.py)


def _replay(machine, state: tuple, hist: bytes, prefix: bytes, ctx) -> tuple:
    """The concrete state after `prefix` from `state` (table states are canonical); ()
    when it dies."""
    for k, b in enumerate(prefix):
        state = machine.advance(state, b, len(hist) + k, ctx)
        if not state:
            return ()
    return state


def _no_ctx(start: int, end: int) -> bytes:
    raise NeedsText


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
