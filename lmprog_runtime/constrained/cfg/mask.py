"""Token masks of a parse state: the vocabulary trie walked against the pushdown matcher.

`MaskEngine.mask(state, hist)` -> bool [n_slots] numpy array (token id -> allowed), cached
per state. A walk steps the matcher once per trie node whose prefix is still alive, so
structural states (a key, a comma, a literal) touch a handful of nodes. Inside a free
string body (no pattern, no enum), where most of the vocabulary stays alive, the tokens
that never leave the string (no `"`, `\\`, control byte; well-formed UTF-8) are
context-independent (xgrammar's observation): their mask is precomputed once per
tokenizer, less those longer than the `maxLength` still left (a numpy compare on each
token's character count), and only the few tokens that can close the string are walked,
cached by the state with its counters clamped to the longest token.
"""
from __future__ import annotations

import bisect
import contextlib
import re
import threading
from collections import OrderedDict
from typing import Optional, Sequence

import numpy as np

from lmprog_runtime.constrained.cfg.canonical import _free_node, free_number_exponent, number_top, unplaced
from lmprog_runtime.constrained.cfg.classtable import ClassTable
from lmprog_runtime.constrained.cfg.machine import (NUM_COMPLETE, NUMBER_BYTES, NUMBER_STEPS, Machine, crowded,
                                                     key_leaves_room, key_rule, utf8_start)
from lmprog_runtime.constrained.cfg.nodes import Node
from lmprog_runtime.constrained.cfg.regex import NEVER, RegexError
from lmprog_runtime.constrained.cfg.table import TableWalker, c_table_walker
from lmprog_runtime.constrained.cfg.unique import UniqueTokens, unique_mask
from lmprog_runtime.constrained.cfg.untrack import untrack
from lmprog_runtime.constrained.trie_walk import TokenTrie

MEMO_STATES = 1024  # cached masks per compiled grammar (LRU), bit-packed: 6 KB each at 49k tokens
MEMO_PARTS = 64     # cached string-body parts per grammar (bool rows)
MEMO_UNIONS = 256   # cached string-body masks (walked part | plain part) per grammar, packed
MAX_DECIDED = 16    # per state read by text: the check lists of its walks kept, and verdicts per list
MAX_NAMES_LEFT = 64  # a closed object's key start is the union of its names' masks up to this many names
MAX_TABLE_CHARS = 32  # plain tokens up to this many characters go through the regex tables
_UNREACHED = ("unreached",)  # (MaskEngine._ctx_key: the stack below an object that cannot close yet)
_UNBOUNDED = ("__unbounded__",)  # (Node._child key: the rule less its length bounds, MaskEngine._bounded)
_DIGIT_RUN = re.compile(rb"[0-9]+")
_NUMBER_RUN = re.compile(rb"[0-9.eE+-]*")  # a token's first bytes a number may take
_EXPONENT_DIGIT = re.compile(rb"[eE][+-]?[0-9]")


class VocabInfo:
    """Per-tokenizer tables shared by every grammar: the trie, plain string-body tokens."""

    def __init__(self, table: Sequence[Optional[bytes]]):
        self.table = table
        self.trie = TokenTrie(table, use_c=False)
        self.n_slots = self.trie.sink + 1
        plain = np.zeros(self.n_slots, dtype=np.bool_)
        chars = np.zeros(self.n_slots, dtype=np.int32)
        special: list[Optional[bytes]] = [None] * len(table)
        for i, data in enumerate(table):
            if not data:
                continue
            n = _plain_chars(data)
            if n is None:
                if data[0] >= 0x20 and utf8_start(data[0]) is not None or data[0] < 0x80 and data[0] >= 0x20:
                    special[i] = data  # (a token whose first byte cannot be in a string body is never walked)
            else:
                plain[i], chars[i] = True, n
        self.plain, self.chars = plain, chars
        self.special = TokenTrie(special, use_c=False)
        # counters clamp at the most characters a walked token can add before it leaves the string
        self.max_special = max((b.find(b'"') if b'"' in b else len(b) for b in special if b), default=1) + 1
        # what a plain string body's counters read of each walked token (MaskEngine._bounded)
        self.str_need, self.str_chars = _string_profiles(special, self.n_slots, self.max_special)
        self._in_string: dict = {}  # (characters left, deficit) -> packed tokens (in_string)
        # plain tokens that end on a character boundary, as code points (CSR by level), for
        # the vectorized regex walk; the others (a character cut by the token's end) are walked
        self.whole = np.zeros(self.n_slots, dtype=np.bool_)
        cps: list[list[int]] = []
        ids: list[int] = []
        for i in np.nonzero(plain)[0].tolist():
            try:
                text = table[i].decode("utf-8")
            except UnicodeDecodeError:
                text = None
            if text is None or len(text) > MAX_TABLE_CHARS:
                special[i] = table[i]  # walked in pattern states
                continue
            self.whole[i] = True
            ids.append(i)
            cps.append([ord(c) for c in text])
        # sorted by their characters, each with the length of the prefix it shares with the
        # one before (the C class walk resumes there: a walk over the tokens' character trie)
        order = sorted(range(len(cps)), key=cps.__getitem__)
        ids, cps = [ids[r] for r in order], [cps[r] for r in order]
        self.whole_lcp = np.asarray([0] + [_shared_prefix(a, b) for a, b in zip(cps, cps[1:])], dtype=np.int32)
        self.whole_ids = np.asarray(ids, dtype=np.int64)
        self.whole_len = np.asarray([len(c) for c in cps], dtype=np.int64)
        self.cps = np.zeros((len(cps), MAX_TABLE_CHARS), dtype=np.int64)  # code points, 0-padded
        for r, c in enumerate(cps):
            self.cps[r, :len(c)] = c
        # the same as indices of the distinct code points (cp_uniq), for the C class walk
        self.cp_uniq, inv = np.unique(self.cps, return_inverse=True)
        idx = inv.reshape(self.cps.shape)
        # flat, each token's characters only (CSR: cp_off[r]..cp_off[r + 1]): the C walk streams
        # these, ~6x fewer bytes than the padded rows
        self.cp_off = np.zeros(len(cps) + 1, dtype=np.int64)
        np.cumsum(self.whole_len, out=self.cp_off[1:])
        self.cp_idx = np.ascontiguousarray(idx[np.arange(MAX_TABLE_CHARS) < self.whole_len[:, None]], dtype=np.int32)
        self.special_or_cut = TokenTrie(special, use_c=False)
        self.max_chars = max((len(b) for b in table if b), default=1) + 1
        # the most ASCII digits in a row in one token (how long an exponent a walk can spell)
        self.max_digits = max((len(r) for b in table if b for r in _DIGIT_RUN.findall(b)), default=0)
        # no token read from inside a number writes an exponent's digit: a walk never completes
        # an exponent, so its mask below a number's `e` reads nothing of the mantissa (canonical.py)
        self.exponent_free = not any(_EXPONENT_DIGIT.search(_NUMBER_RUN.match(b).group()) for b in table if b)
        # no token closes a key and gets past its value's first byte (at most `":"` here):
        # masks inside a key then read the keys seen only where they begin with its text
        self.keys_stop_at_value = not any(_past_value_start(b) for b in table if b and b'"' in b)
        # no token has a quote after a comma and a quote: after a value's `,"` no key closes
        # within the token (so an object's keys seen are read there only by counts and
        # required / dependentRequired checks and a closed object's names left: _ctx_key)
        self.no_key_after_comma = not any(_key_after_comma(b) for b in table if b and b"," in b)
        # ... nor any byte at all: then a closed object's names left are read only by the one
        # byte of lookahead after `,"` (whether any is left)
        self.comma_quote_ends = not any(_after_comma_quote(b) for b in table if b and b"," in b)
        # what tokens spell before their first quote: a key typed so far closes within one
        # token only where the rest of its text is one of these
        self.quote_heads = frozenset(b[:b.index(b'"')] for b in table if b and b'"' in b)
        self.unique = UniqueTokens(table)  # (unique.py: the tokens completing an item, by its value)
        self.lists = _lists(self.trie)
        self.special_lists = _lists(self.special)
        self.cut_lists = _lists(self.special_or_cut)
        # the trie's subtrees under a byte a number may take, cut to the paths of number bytes
        # (MaskEngine._number_mask walks them: `number_lists`), and the other tokens, packed
        self.number_lists, roots = _number_trie(self.lists)
        self.number_subtrees = tuple(r for _, r in roots)
        # the same, without and with only an exponent's `e` / `E` (MaskEngine._number_mask)
        self.number_subtrees_e = tuple(tuple(r for b, r in roots if (b in (0x45, 0x65)) == e) for e in (False, True))
        first = np.zeros(self.n_slots, dtype=np.bool_)
        for t, data in enumerate(table):
            first[t] = bool(data) and data[0] not in NUMBER_BYTES
        self.not_number_first = np.packbits(first, bitorder="little")
        # MaskEngine._number_part of free number frames (no bounds, multipleOf or enum: their
        # steps read only the text, the DFA state and whether the rule is an integer's), for
        # every grammar: (integer only, whole integers, text, DFA state, id(subtrees)) -> packed
        self.free_numbers: dict = {}
        # an int32 bitmask row's bytes of tokens (MaskEngine.write_words): whole ones, and the
        # bits of the last, partial one (the sink slot's bit and those past it clear)
        self.token_bytes, self.token_tail = self.trie.sink >> 3, (1 << (self.trie.sink & 7)) - 1

    def in_string(self, left: int, deficit: int) -> np.ndarray:
        """Packed: the walked tokens whose part inside a plain string body (no pattern, no
        enum) passes its counters with `left` characters still allowed and `deficit` still
        needed before the closing quote (memoized; at most (max_special + 1)^2 of them)."""
        got = self._in_string.get((left, deficit))
        if got is None:
            ok = (self.str_need <= left) & ((self.str_chars < 0) | (self.str_chars >= deficit))
            got = self._in_string[(left, deficit)] = np.packbits(ok, bitorder="little")
        return got


def _string_profiles(special: Sequence[Optional[bytes]], n_slots: int, cap: int):
    """For each token of the walked trie (int32 [n_slots] each): `need`, the fewest
    characters a plain string body must still allow for the token's part inside it (up to
    and including the closing quote, when it has one) to pass its counters (cap + 1: it never
    passes), and `chars`, the characters counted at that closing quote (-1: none). Both
    read off the matcher's own string steps (machine.py, strings.py): every counter check
    compares the characters begun with maxLength (more room never refuses more) and the
    closing quote compares those counted with minLength, so the part passes a body with
    `left` characters allowed and `deficit` needed iff need <= left and, where it closes,
    chars >= deficit. Its tokens have fewer than `cap` bytes before their first quote."""
    need = np.full(n_slots, cap + 1, dtype=np.int32)
    chars = np.full(n_slots, -1, dtype=np.int32)
    machine = Machine(None, None, None, None, 0)  # (a plain body reads neither patterns nor checks)
    bottom = (("D", 0), None)

    def passes(data: bytes, most: Optional[int]):
        node = Node()
        node.max_len = most
        st = [(("S", node, 0, 0, 0, 0, (), None), bottom)]
        for b in data:
            top = st[0][0]
            if top[0] != "S":  # (closed: what follows is the stack below's)
                break
            closing = b == 0x22 and not top[3] and not top[4]
            st = machine._string(top, st[0][1], b, 0, None)
            if not st:
                return False, -1
            if closing:
                return True, top[2]
        return True, -1

    for i, data in enumerate(special):
        if not data:
            continue
        ok, counted = passes(data, None)
        if not ok:
            continue
        lo, hi = 0, cap
        while lo < hi:  # (the fewest: passing is monotone in the characters allowed)
            mid = (lo + hi) // 2
            if passes(data, mid)[0]:
                hi = mid
            else:
                lo = mid + 1
        if lo < cap or passes(data, cap)[0]:
            need[i], chars[i] = lo, counted
    return need, chars


_KEY_CLOSE = re.compile(rb'"[ \t\n\r]*:[ \t\n\r]*')


def _past_value_start(token: bytes) -> bool:
    """Whether `token`, read from inside an object key, might close it and go past the first
    byte of the value (or reach its end: one digit, where the lookahead byte may end the
    number): any quote taken for the key's close."""
    for m in _KEY_CLOSE.finditer(token):
        after = token[m.end():]
        if len(after) > 1 or after[:1].isdigit():
            return True
    return False


_COMMA_QUOTE = re.compile(rb',[ \t\n\r]*"')


def _key_after_comma(token: bytes) -> bool:
    """Whether `token` has a quote after a comma and a quote (a key opened and closed)."""
    return any(b'"' in token[m.end():] for m in _COMMA_QUOTE.finditer(token))


def _after_comma_quote(token: bytes) -> bool:
    """Whether `token` goes on after a comma and a quote (a key's first bytes)."""
    return any(m.end() < len(token) for m in _COMMA_QUOTE.finditer(token))


def _object_sig(frame: tuple, lookahead_only: bool, child=None) -> Optional[tuple]:
    """MaskEngine._ctx_key's form of an object frame in a value (phase 4), after one (2) or
    after a key (1: `child` is that key's value rule): its node, phase, whitespace state and
    what its `,` and `}` and a closed object's next key read of the keys seen (the value's
    key among them), or None (an abstracted key). `lookahead_only`: no token spells a key's
    bytes after `,"`, so of the names left only whether there are any is read (a key rule
    without patterns)."""
    _, node, phase, seen, key, ws = frame
    if phase in (1, 4):
        if type(key) is not str:
            return None
        seen = seen | {key}
    if any(type(k) is not str for k in seen):
        return None
    n = len(seen)
    kn = key_rule(node, seen) if node.max_props is None or n < node.max_props else node.key_node
    comma = ((node.max_props is None or n < node.max_props)
             and (node.additional is not None or bool(node.pattern_props) or n < len(node.props))
             and kn.enum != ())
    close = (node.required <= seen and n >= node.min_props
             and all(set(node.dep_required.get(k) or ()) <= seen for k in seen))
    left = frozenset(e for e in kn.enum if e not in seen) if kn.enum is not None else None
    if left is not None and lookahead_only and not kn.patterns:
        left = bool(left)
    # (under maxProperties, the dependentRequired keys an open key rule's close refuses)
    crowds = (frozenset(k for k in node.dep_required if not key_leaves_room(node, seen, k))
              if kn.enum is None and node.max_props is not None and node.dep_required else None)
    return ("O~", node, phase, ws, comma, close, left, crowds, child)


def _escaped(text: str) -> bool:
    """Whether JSON spells `text` with an escape (a quote, a backslash, a control character,
    a lone surrogate)."""
    return _ESCAPES.search(text) is not None


_ESCAPES = re.compile('["\\\\\x00-\x1f\ud800-\udfff]')  # (what _escaped looks for)


def _lists(trie: TokenTrie):
    return (trie.byte.tolist(), trie.depth.tolist(), trie.skip.tolist(), trie.node_tok.tolist(),
            list(zip(trie.dup_tok.tolist(), trie.dup_src.tolist())))


def _number_trie(lists) -> tuple:
    """The trie (`_lists`' preorder lists) cut to its paths of bytes a number may take, under
    each first byte that one may: (byte, depth, skip, tok, other) lists, `other[i]` set where
    node i has a child of another byte (a token that goes on past a number there), and the
    (first byte, (start, end)) of each subtree in them. Under `e` / `E` / `.` / `-` most of
    the trie is words, which a number's walk would visit one by one only to leave."""
    byte, depth, skip, tok = lists[:4]
    out: tuple = ([], [], [], [], [])
    roots, path = [], []  # (path: the cut trie's open nodes, by depth)
    i = 0
    while i < len(byte):
        if byte[i] not in NUMBER_BYTES:
            i = skip[i]
            continue
        start, end = i, skip[i]
        first = len(out[0])
        while i < end:
            d = depth[i]
            if byte[i] not in NUMBER_BYTES:
                out[4][path[d - 2]] = True  # (its parent: the open node one level up)
                i = skip[i]
                continue
            while len(path) >= d:
                out[2][path.pop()] = len(out[0])
            path.append(len(out[0]))
            for lst, v in zip(out, (byte[i], d, 0, tok[i], False)):
                lst.append(v)
            i += 1
        while path:
            out[2][path.pop()] = len(out[0])
        roots.append((byte[start], (first, len(out[0]))))
        i = end
    return out, roots


def _shared_prefix(a: list, b: list) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _plain_chars(data: bytes) -> Optional[int]:
    """Characters a token adds inside a string body (lead bytes), or None if it may not stay there."""
    n, need = 0, 0
    lo, hi = 0x80, 0xBF
    for b in data:
        if need:
            if not lo <= b <= hi:
                return None
            need -= 1
            lo, hi = 0x80, 0xBF
            continue
        if b < 0x20 or b in (0x22, 0x5C):
            return None
        n += 1
        if b >= 0x80:
            u = utf8_start(b)
            if u is None:
                return None
            need, _, lo, hi = u
    return n


class _Tracked(bytes):
    """The committed output, recording whether a walk read any of it (`ctx` slices it only
    when a pending check reads the captured text; positions come from len())."""

    read = False

    def __getitem__(self, index):
        self.read = True
        return bytes.__getitem__(self, index)


UNPACKED_ROWS = 64  # unpacked masks kept for copying into rows (bool, n_slots bytes each)
_ROWS: OrderedDict = OrderedDict()  # id(packed) -> (packed, its bool row)
_ROWS_LOCK = threading.Lock()


def _unpacked(packed: np.ndarray, n: int) -> np.ndarray:
    """bool [n] of a packed mask, from the process-wide LRU where the same array (the memo's
    object: identity, not value; an entry holds its array, so no other takes its id) was
    unpacked lately."""
    got = _ROWS.get(id(packed))  # (read without the lock: a dict read is atomic, the entry is checked)
    if got is not None and got[0] is packed:
        try:
            _ROWS.move_to_end(id(packed))
        except KeyError:  # (evicted meanwhile by another thread)
            pass
        return got[1]
    row = np.unpackbits(packed, count=n, bitorder="little").view(np.bool_)
    with _ROWS_LOCK:
        _ROWS[id(packed)] = (packed, row)
        while len(_ROWS) > UNPACKED_ROWS:
            _ROWS.popitem(last=False)
    return row


_CROSSES = object()  # VocabInfo.free_numbers: a number part the walk decides (MaskEngine._number_part's None)
_BY_STATES = object()  # _key_near: a key's text told by the names it may complete and its pattern states


def _names_from(node, typed: str) -> list:
    """The declared property names of object `node` that begin with `typed` (by bisection
    in the names sorted once per node)."""
    names = node._child.get(_SORTED)
    if names is None:
        names = node._child[_SORTED] = sorted(node.props)
    lo = bisect.bisect_left(names, typed)
    hi = lo
    while hi < len(names) and names[hi].startswith(typed):
        hi += 1
    return names[lo:hi]


_TOKEN_CHARS = 32  # _pattern_state: how far back a key's previous text is looked for
_SORTED = ("__sorted_names__",)  # (a tuple: no property name collides with it in Node._child)


def _closable(name: str, typed: str, heads: frozenset) -> bool:
    """A token may finish key `name` from `typed` (its prefix) and close it: the rest is
    spelled before a quote by some token (VocabInfo.quote_heads), or needs an escape."""
    rest = name[len(typed):]
    return _escaped(rest) or rest.encode() in heads


_BY_TEXT = object()  # memo marker: this state's masks read the captured text (keyed by it too)


def _one_name(node, name: str):
    """The key rule of closed object `node` that allows `name` alone (memoized on it)."""
    return node.key_node.twin(("__key__", name), enum=(name,))


def _capture_start(state: tuple):
    """The first output byte a pending check (C / U frame) of `state` will read, or None."""
    start = None
    for st in state:
        while st is not None:
            frame = st[0]
            if frame[0] == "C":
                start = frame[2] if start is None else min(start, frame[2])
            elif frame[0] == "U":
                start = frame[1] if start is None else min(start, frame[1])
            st = st[1]
    return start


class MaskEngine:
    def __init__(self, machine: Machine, vocab: VocabInfo, use_c: bool = True):
        """use_c=False: the Python walk only (the tests' oracle)."""
        self.machine, self.vocab, self.use_c = machine, vocab, use_c
        self._json = isinstance(machine, Machine)  # (JSON Schema states: _key_near reads their frames)
        self._tw = None  # TableWalker, False where the C walk cannot be built
        self._walk_lock = threading.Lock()  # the walker's table is mutated by a walk
        self._memo: OrderedDict = OrderedDict()
        self._lock = threading.Lock()
        self._alive: dict[int, np.ndarray] = {}
        self._needs: dict[int, np.ndarray] = {}  # pattern state -> what it needs after each plain token (_regex_need)
        self._parts: dict = {}
        self._unions: dict = {}  # (id(walked), id(plain part)) -> (walked, part, their union); _bounded's and _value_mask's too
        self._bodies: dict = {}  # a string body's fast-key parts and id(stack below) -> (that stack, its mask)
        self._plain_stacks: dict = {}  # id(stack) -> (that stack, whether it holds no check or items seen: _number_memo)
        self._values: dict = {}  # (value string rule, id(stack below)) -> that stack, its body's parts (_value_mask)
        self._local = threading.local()  # read_text: whether this thread's last walk read the text
        self._table: Optional[ClassTable] = None
        self._pstates: dict = {}  # (pattern term, key text) -> its state (_pattern_state)
        self._names: dict = {}  # (object node, key name) -> that name's tokens at a key's first byte (_names_left)
        self._numbers: dict = {}  # a number frame -> its number-byte tokens (_number_part)
        self._decided: dict = {}  # a state read by text -> its walks' checks -> their verdicts -> mask (_decide)
        self._decided_n = 0  # (the masks it holds)

    def mask(self, state: tuple, hist: bytes) -> np.ndarray:
        """bool [n_slots]: the tokens allowed from `state` after the output `hist`."""
        return np.unpackbits(self.mask_packed(state, hist), count=self.vocab.n_slots, bitorder="little").view(np.bool_)

    def mask_packed(self, state: tuple, hist: bytes) -> np.ndarray:
        """The same, packed (np.packbits, bitorder="little": an int32 bitmask's bytes; uint8
        [ceil(n_slots / 8)]): memo hits are ORed as packed words, unpacked (if at all) once by
        the caller."""
        if len(state) > 1:  # alternatives are independent: the union of their masks (each cached)
            out = self.mask_packed(state[:1], hist)
            for st in state[1:]:
                out = out | self.mask_packed((st,), hist)
            return out
        key = self._fast_key(state)
        body = None
        if key is not None and state[0][0][0] == "S":  # a string body: the same stack below it along its tokens
            # (the plain part's characters left too: counted up to max_chars, the walked
            # part's (the fast key's) up to max_special only)
            body = key[1][0][:5] + (self._plain_left(state[0][0]), id(state[0][1]))
            got = self._bodies.get(body)  # (an entry holds that stack: its id is not reused meanwhile)
            if got is not None:
                return got[1]
        got = self._bounded(key, state, hist) if body is not None else None
        if got is None:
            got = self._masked(key, state, hist)
        if key is None:
            return got
        top = state[0][0]  # (the string body's plain tokens within its counters)
        done = self._union(got, self._packed_part(("R", top[1])) if top[0] == "R" else self._plain_part(top))
        if body is not None and _capture_start(state) is None:  # (a captured text may be read: never by id)
            with self._lock:
                if len(self._bodies) >= MEMO_UNIONS:
                    self._bodies.clear()
                self._bodies[body] = entry = (state[0][1], done)
            untrack(body)  # (immutable, held as long as the entry: out of the collector's view, untrack.py)
            untrack(entry)
        return done

    def _union(self, got: np.ndarray, part: np.ndarray) -> np.ndarray:
        """`got | part`, memoized by the two arrays (`_unions`: an entry holds both, so their
        ids are not reused meanwhile)."""
        pair = (id(got), id(part))
        done = self._unions.get(pair)
        if done is None:
            done = (got, part, got | part)
            with self._lock:
                if len(self._unions) >= MEMO_UNIONS:
                    self._unions.clear()
                self._unions[pair] = done
        return done[2]

    def _bounded(self, key, state: tuple, hist: bytes) -> Optional[np.ndarray]:
        """The walked part of a plain string value's body whose rule bounds its length
        (no pattern, no enum, no check reading its text below), or None: that of the same
        body under its rule less the bounds (one twin per rule: memoized for every length),
        ANDed with the tokens whose part inside the string passes its counters
        (VocabInfo.in_string). The part after a token's closing quote is read by the stack
        below alone (a value string's close passes no text on), and the part before it by
        the counters alone, so a string with maxLength / minLength walks once per context,
        not once per length."""
        top, rest = state[0]
        node = top[1]
        if top[6] or top[7] is not None or (node.max_len is None and not node.min_len):
            return None
        if _capture_start(state) is not None:
            return None
        base = self._unbounded_part(top, rest, hist)
        _, left, deficit = key[1][0][:3]
        pair = (id(base), left, deficit)
        done = self._unions.get(pair)  # (an entry holds the array: its id is not reused meanwhile)
        if done is None:
            done = (base, base & self.vocab.in_string(left, deficit))
            with self._lock:
                if len(self._unions) >= MEMO_UNIONS:
                    self._unions.clear()
                self._unions[pair] = done
        return done[1]

    def _unbounded_part(self, top: tuple, rest, hist: bytes) -> np.ndarray:
        """The walked part of a string body at a character boundary under its rule less the
        length bounds (one twin per rule, count 0: the same for every length)."""
        free = ((("S", top[1].twin(_UNBOUNDED, min_len=0, max_len=None), 0) + top[3:], rest),)
        return self._masked(self._fast_key(free), free, hist)

    def write_row(self, state: tuple, hist: bytes, row: np.ndarray, overwrite: bool) -> None:
        """The allowed tokens of `state` written into the numpy bool row (the rest of it,
        past the vocabulary, False), or ORed into it. A mask met again is copied from its
        unpacked row (the last UNPACKED_ROWS kept, process-wide), not unpacked again."""
        packed = self.mask_packed(state, hist)
        n, m = self.vocab.n_slots, row.shape[0]
        allowed = _unpacked(packed, n)
        if m <= n:  # (the common case: the row is the vocabulary, the trie's sink slot past it)
            src = allowed if m == n else allowed[:m]
            if overwrite:
                np.copyto(row, src)
            else:
                np.logical_or(row, src, out=row)
            return
        if overwrite:
            np.copyto(row[:n], allowed)
            row[n:] = False
        else:
            np.logical_or(row[:n], allowed, out=row[:n])

    def write_words(self, state: tuple, hist, out: np.ndarray) -> None:
        """The allowed tokens of `state` written over the uint8 view `out` of an int32
        bitmask row (bit j of byte b: token 8b + j; the masks are packed in that order): the
        packed mask copied, the trie's sink slot and everything past the vocabulary clear.
        `hist` (bytes or the matcher's bytearray) is copied only where the memo misses."""
        packed = None
        if len(state) == 1:  # (a memo hit keyed by the state itself: mask_packed's first lookup,
            st = state[0]    # less the calls around it)
            if st is not None:
                top = st[0]
                if type(top) is tuple and top[0] == "S":
                    packed = (self._value_mask(top, st[1], hist) if top[7] is None
                              else self._key_mask(top, st[1], hist))
                elif type(top) is tuple and top[0] not in ("S", "R"):
                    memo = self._memo
                    got = memo.get(state)
                    if got is not None and got is not _BY_TEXT:
                        try:
                            memo.move_to_end(state)
                        except KeyError:  # (evicted meanwhile by another thread)
                            pass
                        packed = got
                    elif top[0] == "N":
                        packed = self._number_memo(top, st[1])
        if packed is None:
            packed = self.mask_packed(state, bytes(hist))
        m = out.shape[0]
        k = self.vocab.token_bytes  # whole bytes of tokens (the trie's sink slot is past them)
        if k >= m:
            out[:] = packed[:m]
            return
        out[:k] = packed[:k]
        out[k] = packed[k] & self.vocab.token_tail
        out[k + 1:] = 0

    def _value_mask(self, top: tuple, rest, hist) -> Optional[np.ndarray]:
        """mask_packed of a value string's body at a character boundary (no pattern, no enum,
        no pending check below it), or None where this does not apply: the same parts, found
        by the rule and the stack below (the same object along the string's tokens) without
        making the fast key. A rule without length bounds has one mask for every count; a
        bounded one's is its walked part under the rule less the bounds (`_bounded`), ANDed
        with the tokens passing its counters, ORed with the plain tokens within its
        characters left, memoized per counts (far from the bounds they are clamped: one mask
        for most of a long string)."""
        node = top[1]
        if top[3] or top[4] or top[5] or top[6] or node.enum is not None:
            return None
        got = self._values.get((node, id(rest)))  # (an entry holds that stack: its id is not reused meanwhile)
        if got is None or got[0] is not rest:
            state = ((top, rest),)
            if _capture_start(state) is not None:  # (a check below may read the text: the caller's path)
                got = (rest, None, None)
            elif node.max_len is None and not node.min_len:  # (every count's mask is the same)
                got = (rest, self.mask_packed(state, bytes(hist)), None)
            else:
                got = (rest, None, self._unbounded_part(top, rest, bytes(hist)))
            with self._lock:
                if len(self._values) >= MEMO_UNIONS:
                    self._values.clear()
                self._values[(node, id(rest))] = got
            untrack(got)
        base = got[2]
        if base is None:
            return got[1]
        _, left, deficit = self._body_part(top, rest)[:3]
        key = (id(base), left, deficit, self._plain_left(top))
        done = self._unions.get(key)  # (an entry holds the walked part: its id is not reused meanwhile)
        if done is None:
            done = (base, (base & self.vocab.in_string(left, deficit)) | self._plain_part(top))
            with self._lock:
                if len(self._unions) >= MEMO_UNIONS:
                    self._unions.clear()
                self._unions[key] = done
        return done[1]

    def _number_memo(self, top: tuple, rest) -> Optional[np.ndarray]:
        """A number's mask kept under its canonical state's key (`_masked`'s `_canon_key`: the
        number frame's canonical form over the stack below as it is, where that holds no
        pending check or uniqueItems array with items seen, which canonical forms or
        `unique_mask` read), or None: the caller's path. A number's text changes at every
        token, so its state's own key is never met again; this one is, and is not stored
        under the state (which would push masks met again out of the LRU)."""
        got = self._plain_stacks.get(id(rest))  # (an entry holds that stack: its id is not reused meanwhile)
        if got is None or got[0] is not rest:
            st, plain = rest, True
            while st is not None and plain:
                frame = st[0]
                plain = frame[0] not in ("C", "U") and not (frame[0] == "A" and frame[4])
                st = st[1]
            got = (rest, plain)
            with self._lock:
                if len(self._plain_stacks) >= MEMO_UNIONS:
                    self._plain_stacks.clear()
                self._plain_stacks[id(rest)] = got
        if not got[1] or not self._walker():
            return None
        return self._recall(("canon", ((number_top(top, self.vocab.exponent_free), rest),)))

    def _key_mask(self, top: tuple, rest, hist) -> Optional[np.ndarray]:
        """mask_packed of a key's body at a character boundary (no enum), or None where this
        does not apply: its fast key made in place, and no body key (a key's text changes
        at every token: `_bodies` would not meet it again)."""
        node = top[1]
        if top[3] or top[4] or top[5] or node.enum is not None:
            return None
        key = ("fast", (self._body_part(top, rest),))
        got = self._memo.get(key)  # (_masked's first lookup, inline: a key's masks are mostly met in the warm-up)
        if got is None or got is _BY_TEXT:
            got = self._masked(key, ((top, rest),), bytes(hist))
        else:
            try:
                self._memo.move_to_end(key)
            except KeyError:  # (evicted meanwhile by another thread)
                pass
        part = self._parts.get((top[6], self._plain_left(top)))  # (_plain_part's lookup, inline)
        return self._union(got, self._plain_part(top) if part is None else part)

    def _masked(self, key, state: tuple, hist: bytes) -> np.ndarray:
        """The walked part of the mask, memoized by `key` (or the state). Under a pending
        check (C / U frame) the captured text is part of the key only when the walk read it
        (some token completes the checked value; _BY_TEXT marks such states): the mask is
        otherwise the same for every text, and for every state alike under the canonical
        and context keys (the checks' starts unplaced), where it is stored too."""
        base_key = memo_key = key if key is not None else state
        with self._lock:
            got = self._memo.get(base_key)
            if got is _BY_TEXT:
                self._memo.move_to_end(base_key)
                memo_key = (base_key, hist[_capture_start(state):])
                got = self._memo.get(memo_key)
            if got is not None:
                self._memo.move_to_end(memo_key)
        if got is not None:
            return got
        if memo_key is not base_key:  # (a walk of this state read the text: maybe with these verdicts)
            got = self._decided_mask(base_key, hist)
            if got is not None:
                return self._as_own(memo_key, got)
        start = _capture_start(state)  # (read past a hit only: a state's stack may be deep)
        if self._json and self.use_c:  # (the oracle walks every mask)
            out = unique_mask(self, key, state, hist)  # (items seen: from the mask with none seen)
            if out is not None:  # (its own key only, and its text's where it captures: it reads the text typed)
                with self._lock:
                    if start is not None and memo_key is base_key:
                        self._memo[base_key] = _BY_TEXT
                        memo_key = (base_key, hist[start:])
                    self._memo[memo_key] = out
                    while len(self._memo) > MEMO_STATES:
                        self._memo.popitem(last=False)
                untrack(memo_key)
                return out
        # the other keys of the state, each made only when the one before it was not met (a
        # mask met under one holds for every text: kept under the state's own key too, which
        # its next visit meets first)
        own = base_key if memo_key is base_key else None
        canon = self._canon_key(key, state, start)
        got = self._recall(canon)
        if got is not None:
            return self._as_own(own, got)
        near = self._key_near(key, state, start)
        got = self._recall(near)
        if got is not None:
            return self._as_own(own, got)
        ctx = cctx = None
        if near is None:
            ctx = self._ctx_key(key, state, start)
            got = self._recall(ctx)
            if got is not None:
                return self._as_own(own, got)
            if canon is not None:
                # both at once: the canonical form's objects told by their checks (a free
                # number's value in an object met after other keys: neither alone shares it)
                cctx = ctx if canon[1] is state else self._ctx_key(key, canon[1], start)
                cctx = ("cctx",) + cctx if cctx is not None else None
                got = self._recall(cctx)
                if got is not None:
                    return self._as_own(own, got)
        tracked = _Tracked(hist) if start is not None else hist
        out = self._names_left(key, state, start, hist)
        if out is None:
            out = self._number_mask(key, state, tracked, canon)
        log = None
        if out is None:
            if start is not None and self._json and self.use_c:  # (the walk's reads of the text recorded: _decide)
                log = self.machine.reads.log = []
            try:
                out = self._compute(key, state, tracked)
            finally:
                if log is not None:
                    self.machine.reads.log = None
        if log is not None and tracked.read:
            self._decide(base_key, len(hist), log, out)
        with self._lock:
            if start is not None and tracked.read and memo_key is base_key:
                self._memo[base_key] = _BY_TEXT
                memo_key = (base_key, hist[start:])
            self._memo[memo_key] = out
            if canon is not None and not self._local.read_text:
                self._memo[canon] = out
                if cctx is not None:
                    self._memo[cctx] = out
            if start is None or not tracked.read:  # (under a pending check: where its text was not read)
                for other in (near, ctx):
                    if other is not None:
                        self._memo[other] = out
            while len(self._memo) > MEMO_STATES:
                self._memo.popitem(last=False)
        for k in (memo_key, canon, cctx, near, ctx):  # (the memo's keys: immutable, untrack.py)
            if k is not None:
                untrack(k)
        return out

    def _names_left(self, key, state: tuple, start, hist: bytes) -> Optional[np.ndarray]:
        """At the first byte of a closed object's key (its rule an enum: the names not yet
        seen), the union of each such name's own mask there (memoized per object and name),
        or None. A token there spells the start of a name, or closes it and gets at most to
        its value's first byte (VocabInfo.keys_stop_at_value): it reads of the keys seen only
        that its name is not among them, so a name's tokens are the same whatever else was
        seen, and a key met after another set of keys costs an OR per name left, not a walk.
        The names' masks are made during the compile's warm-up (`warming`: a walk per name
        costs more than one walk of them all); a name not met then leaves the key to a walk."""
        if (key is not None or start is not None or not self._json or not self.vocab.keys_stop_at_value
                or len(state) != 1 or state[0] is None):
            return None
        top, rest = state[0]
        if (type(top) is not tuple or top[0] != "S" or type(top[7]) is not str or top[7] or top[2] or top[3]
                or top[4] or top[5] or top[1].enum is None or not 0 < len(top[1].enum) <= MAX_NAMES_LEFT
                or rest is None):
            return None
        obj = rest[0]
        if type(obj) is not tuple or obj[0] != "O" or obj[4] is not None:
            return None
        node = obj[1]
        if node.key_node is None or node.key_node.residual is not None:
            return None
        names = self._names
        if not getattr(self._local, "warming", False) and any((node, n) not in names for n in top[1].enum):
            return None  # (a walk costs less than a walk per name: those are paid at compile)
        out = None
        for name in top[1].enum:
            got = names.get((node, name))
            if got is None:  # (that name alone is the key rule: the walk spells its tokens)
                one = _one_name(node, name)
                got = self._compute(None, (((top[0], one) + top[2:], rest),), hist)
                with self._lock:
                    if len(names) >= MEMO_STATES:
                        names.clear()
                    names[(node, name)] = got
            out = got.copy() if out is None else np.bitwise_or(out, got, out=out)
        self._local.read_text = True  # (not stored under the canonical key: that one is the walk's)
        return out

    def _number_mask(self, key, state: tuple, hist: bytes, canon) -> Optional[np.ndarray]:
        """Inside a number: the tokens whose first byte a number may take (its digits, `.`,
        `e`, signs: they step the number frame alone, `_number_part`) and the others read off
        the mask of the number's end (Machine._number: a byte the number does not take steps
        the states `finish` leaves, at the same position; none of those takes a number's
        byte), or None. A new context, or a number whose text a check keeps, no longer walks
        the whole vocabulary: its end is a state met before."""
        if key is not None or not self._json or not self.use_c or len(state) != 1 or state[0] is None:
            return None
        top, rest = state[0]
        if type(top) is not tuple or top[0] != "N" or rest is None or canon is None or len(canon[1]) != 1:
            return None
        ctop, crest = canon[1][0]
        if type(ctop) is not tuple or ctop[0] != "N":
            return None
        v = self.vocab
        # an exponent's `e` is stepped from the concrete text where a token may spell enough
        # exponent digits for the mantissa to matter (table.py _derive_byte; a bounded number's
        # class text serves: its exponent's first byte passes whatever the mantissa)
        concrete = v.max_digits >= 17 and free_number_exponent(canon[1], 0x65)
        packed = self._number_part(ctop, v.number_subtrees if not concrete else v.number_subtrees_e[0])
        if packed is not None and concrete:
            part = self._number_part(top, v.number_subtrees_e[1])
            packed = None if part is None else packed | part
        if packed is None:
            return None
        if top[3] in NUM_COMPLETE and top[1].number_ok(top[2]):
            ends = self.machine.finish(rest, None, len(hist), lambda a, b: hist[a:b])
            if ends:
                packed = packed | (self.mask_packed(tuple(dict.fromkeys(ends)), hist) & v.not_number_first)
        # the number's own tokens are its canonical text's (its class's: canonical.py), its
        # end's the stack below's: the mask is stored under the canonical key where that
        # stack is its canonical form and no text was read
        self._local.read_text = getattr(hist, "read", False) or concrete or (crest is not rest and crest != rest)
        return packed

    def _number_part(self, top: tuple, subtrees: tuple) -> Optional[np.ndarray]:
        """Packed: the tokens in the trie's `subtrees` (under bytes a number may take) that
        number frame `top` (whatever lies below it) allows, each ending where a number byte
        continues it, or None where one ends where none does or goes on past the number's
        end (the stack below then reads it: the walk decides). Memoized per frame and
        subtrees."""
        got = self._numbers.get((top, subtrees))
        if got is not None:
            return got
        v, step = self.vocab, self.machine.step
        node = top[1]
        shared = None
        if _free_node(node):  # (the same for every grammar: read once per tokenizer)
            shared = (node.integer_only(), self.machine.whole_integers, top[2], top[3], id(subtrees))
            got = v.free_numbers.get(shared)
            if got is not None:
                return None if got is _CROSSES else got
        byte, depth, skip, tok, other = v.number_lists
        out = np.zeros(v.n_slots, dtype=np.bool_)
        sink = v.trie.sink
        frames = [top] * 258  # frames[d]: the number after the first d bytes of the current path
        for i0, i1 in subtrees:
            i = i0
            while i < i1:
                d, b = depth[i], byte[i]
                f = frames[d - 1]
                got = step((f, None), b, 0, None) if b in NUMBER_STEPS[f[3]] else None
                if not got:  # (a byte the number does not take: its end's, and none takes a number byte)
                    i = skip[i]
                    continue
                f = frames[d] = got[0][0]
                if tok[i] != sink:
                    if not any(step((f, None), c, 0, None) for c in NUMBER_STEPS[f[3]]):
                        return self._free_part(shared, None)
                    out[tok[i]] = True
                if other[i] and f[3] in NUM_COMPLETE:  # (a token going on past the number's end:
                    return self._free_part(shared, None)  # the stack below reads it)
                i += 1
        for t, src in v.lists[4]:
            out[t] = out[src]
        got = np.packbits(out, bitorder="little")
        with self._lock:
            if len(self._numbers) >= MEMO_UNIONS:
                self._numbers.clear()
            self._numbers[(top, subtrees)] = got
        return self._free_part(shared, got)

    def _free_part(self, shared, got: Optional[np.ndarray]) -> Optional[np.ndarray]:
        """`got` (a free number's part, or None: the walk decides), kept for every grammar
        under `shared` (None: not a free number's)."""
        if shared is not None:
            numbers = self.vocab.free_numbers
            with self._lock:
                if len(numbers) >= MEMO_STATES:
                    numbers.clear()
                numbers[shared] = _CROSSES if got is None else got
        return got

    @contextlib.contextmanager
    def warming(self):
        """This thread computes masks ahead of requests (cfg/warmup.py): a closed object's
        key start then makes each name's own mask (`_names_left`)."""
        self._local.warming = True
        try:
            yield
        finally:
            self._local.warming = False

    def _decide(self, key, n: int, log: list, out: np.ndarray) -> None:
        """Keep a walk's mask under the verdicts of the checks it made on the output text
        (its only reads of it: none of a uniqueItems item). The walk goes from the state's
        canonical form the same way until a check's verdict differs, so another text of the
        same state with the same verdicts on the same checks has the same mask: the checks
        are kept as (start in the committed output or None, the text after it, rule)."""
        if not log or None in log:
            return
        checks = tuple((s, t[n - s:], rule) if s < n else (None, t, rule) for s, t, rule, _ in log)
        ident = tuple((s, t, id(rule)) for s, t, rule in checks)  # (a rule is a schema: a dict)
        verdicts = tuple(ok for _, _, _, ok in log)
        with self._lock:
            if self._decided_n >= MEMO_UNIONS:  # (masks kept: MEMO_UNIONS at most, as many bit-packed rows)
                self._decided.clear()
                self._decided_n = 0
            per = self._decided.setdefault(key, {})
            if ident in per or len(per) < MAX_DECIDED:
                got = per.setdefault(ident, (checks, {}))[1]
                if len(got) < MAX_DECIDED and verdicts not in got:
                    got[verdicts] = out
                    self._decided_n += 1

    def _decided_mask(self, key, hist: bytes) -> Optional[np.ndarray]:
        """The mask of state `key` after `hist` read off a walk of it whose checks give the
        same verdicts on this text (`_decide`), or None."""
        per = self._decided.get(key)
        if not per:
            return None
        valid = self.machine.residual.valid_text
        for checks, got in list(per.values()):
            verdicts: list = []  # (this text's, made as far as a walk's agree)
            for kept, out in list(got.items()):
                for k, (s, t, rule) in enumerate(checks):
                    if k == len(verdicts):
                        verdicts.append(valid(hist[s:] + t if s is not None else t, rule))
                    if verdicts[k] != kept[k]:
                        break
                else:
                    return out
        return None

    def _as_own(self, key, got: np.ndarray) -> np.ndarray:
        """`got` stored under the state's own `key` too (None: not where that key is marked
        _BY_TEXT: a walk of that state read its text)."""
        if key is not None:
            with self._lock:
                self._memo[key] = got
                while len(self._memo) > MEMO_STATES:
                    self._memo.popitem(last=False)
            untrack(key)
        return got

    def _recall(self, key) -> Optional[np.ndarray]:
        """The memoized mask under `key` (None: no key, or none stored)."""
        if key is None:
            return None
        with self._lock:
            got = self._memo.get(key)
            if got is not None:
                self._memo.move_to_end(key)
        return got

    def _canon_key(self, key, state: tuple, start) -> Optional[tuple]:
        """The memo key of a state's canonical form (cfg/table.py: a free number's digits,
        a key of additionalProperties abstracted, a bounded number's text its class's),
        where the C walk runs: a walk that read no text (TableWalker.read_text) is stored
        under it too, so states alike but for what canonical() drops share one walk (a
        state already canonical, too: the first of its class met may be either)."""
        if key is not None or not self._walker():
            return None
        return ("canon", self._tw._canon(state))

    def _key_near(self, key, state: tuple, start) -> Optional[tuple]:
        """The memo key of a state inside an object key (its one stack: the key's string
        frame over its object's), with the keys seen cut to those that begin with the text
        typed (and the stack below the object left out), where no token gets past the
        value's first byte (VocabInfo.keys_stop_at_value): a token then reads the keys seen
        only to ask whether the key it closes is new (a key with that text as its prefix)
        and which declared names may still follow that text, and never reaches the object's
        `,` / `}` or anything below it. So the masks at one key position are shared by every
        set of keys seen before it that agrees on keys with that prefix (under a pending
        check too: no token inside a key completes the checked value, and `_masked` stores
        the key only where the walk read no captured text)."""
        if not self._json or not self.vocab.keys_stop_at_value or len(state) != 1 or state[0] is None:
            return None
        top, rest = state[0]
        if type(top) is not tuple or top[0] != "S" or type(top[7]) is not str or rest is None:
            return None
        obj = rest[0]
        if type(obj) is not tuple or obj[0] != "O" or obj[4] is not None:
            return None
        typed, seen = top[7], obj[3]
        if any(type(k) is not str for k in seen):
            return None
        near = frozenset(k for k in seen if k.startswith(typed))
        crowds = None  # (under maxProperties: the key rule the keys seen leave, and the keys whose close they refuse)
        if crowded(obj[1]):
            crowds = (top[1], frozenset(k for k in obj[1].dep_required if not key_leaves_room(obj[1], seen, k)))
        if top[1].enum is None and not (top[3] or top[4] or top[5]):  # (no escape or character pending)
            # an open key rule: the keys seen are read only by a close, so only those the
            # rest of whose text a token spells before its quote
            heads = self.vocab.quote_heads
            near = frozenset(k for k in near if _closable(k, typed, heads))
            kn, node = top[1], obj[1]
            if kn.residual is None:
                # no propertyNames check reads the whole text: a close reads it only by the
                # names it may complete (seen or declared: then the text is kept, as which
                # tokens complete them depends on it) and by the patternProperties' patterns
                # (their states after it), so every text that may complete no name shares
                # the masks of those states (an undeclared key's text with no pattern: all
                # alike), but for how many characters it has where that is counted
                named = (near or any(_closable(k, typed, heads) for k in _names_from(node, typed))
                         or (crowds is not None and any(k.startswith(typed) and _closable(k, typed, heads)
                                                        for k in crowds[1])))
                try:
                    pats = tuple(self._pattern_state(term, typed) for term, _ in node.pattern_props)
                except RegexError:
                    pats = None
                if pats is not None:
                    count = top[2] if kn.max_len is not None else min(top[2], kn.min_len)
                    return ("key", key is not None, node, near, obj[5], count, top[6], pats,
                            typed if named else _BY_STATES, crowds)
        return ("key", key is not None, obj[1], near, obj[5], crowds) + top[2:]  # (not the phase: 0 or 3, never read)

    def _pattern_state(self, term: int, text: str) -> int:
        """The state of pattern `term` after `text` (memoized: keys are typed a token at a
        time, so the state after a shorter prefix, up to a token's length back, is resumed)."""
        got = self._pstates.get((term, text))
        if got is None:
            pool = self.machine.pool
            got, todo = term, text
            for k in range(1, min(len(text), _TOKEN_CHARS) + 1):
                head = self._pstates.get((term, text[:-k]))
                if head is not None:
                    got, todo = head, text[-k:]
                    break
            for ch in todo:
                if got == pool.NONE:
                    break
                got = pool.step(got, ord(ch))
            if len(self._pstates) >= MEMO_STATES:
                self._pstates.clear()
            self._pstates[(term, text)] = got
        return got

    def _ctx_key(self, key, state: tuple, start) -> Optional[tuple]:
        """The memo key of a state with each object it is inside (and an object whose value
        just ended) told by what a token can still ask of its keys seen, not by them: whether
        a `,` may follow (maxProperties, a closed object's names all seen), whether `}` may
        (required, minProperties, dependentRequired) and, for a closed object, the names
        left (a key a token starts after `,"`). No key closes within a token after a comma
        (VocabInfo.no_key_after_comma), so nothing else reads them: the value of a property
        met after other keys than the sample's, or in another order, shares its masks. An
        object right after a key (phase 1, on top) is told so too, with its value's rule; a
        string body on the fast path by its frame as `_fast_key` reads it. Below an object
        that may not close (a required key not seen), nothing: no token gets past its `}`
        (its keys seen do not change within a token), so no step reads that stack. Under a
        pending check its start is left out (read only with the text: `_masked` stores such
        a key only where the walk read none), so such a state has this key with no object
        too: a string item of a uniqueItems array with none seen (unique.py) is one mask
        wherever the item begins."""
        if not self._json or not self.vocab.no_key_after_comma or len(state) != 1 or state[0] is None:
            return None
        frames, changed, st = [], start is not None, state[0]  # (a check's start left out: a key of its own)
        if key is not None:  # a string body on the fast path: its frame as _fast_key reads it (counts clamped)
            frames.append(("fast",) + key[1][0][:5])
            st = st[1]
        while st is not None:
            fr = st[0]
            if start is not None and type(fr) is tuple and fr[0] in ("C", "U"):
                # (a check's start: read only with the text; a uniqueItems array's items seen
                # stay: a token completing an item reads them without reading the text)
                fr = unplaced(fr)
            if type(fr) is tuple and fr[0] == "O" and (fr[2] == 4 or (fr[2] in (1, 2) and not frames)):
                child = self.machine._child_of(fr[1], fr[4]) if fr[2] == 1 and type(fr[4]) is str else None
                fr = _object_sig(fr, self.vocab.comma_quote_ends, child)
                if fr is None:
                    return None
                changed = True
                if not fr[5]:  # (it cannot close within a token: nothing below it is read)
                    frames.append(fr)
                    frames.append(_UNREACHED)
                    break
            frames.append(fr)
            st = st[1]
        return ("ctx", key is not None, tuple(frames)) if changed else None

    def _plain_part(self, top) -> np.ndarray:
        """The plain tokens an S frame allows, packed: all (or those its patterns survive),
        less those longer than the characters left (cached per patterns and characters left)."""
        return self._packed_part((top[6], self._plain_left(top)))

    def _plain_left(self, top) -> Optional[int]:
        """The characters an S frame's plain tokens may still add (None: no maxLength),
        clamped where no count past it tells tokens apart: the longest token, and with
        patterns what they may still need after one (`_cap`)."""
        node = top[1]
        return None if node.max_len is None else min(node.max_len - top[2], self._cap(top[6], self.vocab.max_chars))

    def _cap(self, pats, longest: int) -> int:
        """The characters left from which a string body's tokens (at most `longest`
        characters) are the same: past `longest`, and past what its patterns may need after
        any token (RegexPool.most_needed: a token after which a pattern needs more
        characters than are left is refused, strings.py `_fits`)."""
        if not pats:
            return longest
        most = self.machine.pool.most_needed
        return longest + max(most(p) for p in pats)

    def _packed_part(self, key) -> np.ndarray:
        """Packed string-body part `key`: (patterns, characters left or None), or ("R",
        term) for a whole-output regex at a character boundary (MEMO_PARTS of them)."""
        got = self._parts.get(key)
        if got is None:
            v = self.vocab
            if key[0] == "R":
                got = self._alive_all((key[1],))
            else:
                got = v.plain if not key[0] else self._alive_all(key[0])
                if key[1] is not None and key[0] and key[1] < self._cap(key[0], v.max_chars):
                    got = got & (v.chars + self._plain_need(key[0]) <= key[1])  # (the patterns keep their room)
                elif key[1] is not None:
                    got = got & (v.chars <= key[1])
            got = np.packbits(got, bitorder="little")
            with self._lock:
                if len(self._parts) >= MEMO_PARTS:
                    self._parts.clear()
                self._parts[key] = got
        return got

    def _alive_all(self, pats) -> np.ndarray:
        alive = self.vocab.whole
        for p in pats:
            alive = alive & self._regex_alive(p)
        return alive

    def _plain_need(self, pats) -> np.ndarray:
        """int32 [n_slots]: per plain token, the characters the patterns `pats` need at least
        after it (RegexPool.min_chars of the state it ends in, the most of them; a token
        after which one is dead: NEVER)."""
        out = None
        for p in pats:
            got = self._regex_need(p)
            out = got if out is None else np.maximum(out, got)
        return out

    def _compute(self, key, state: tuple, hist: bytes) -> np.ndarray:
        """The walked part of a mask (all of it off the fast path), packed."""
        return self._walk(state, hist, *self._trie_of(key, state))

    def _trie_of(self, key, state: tuple):
        """The trie a state's walk covers: all tokens, or on the string-body fast path the
        special ones (and with patterns those cut mid-character): (trie, its lists)."""
        v = self.vocab
        if key is None:
            return v.trie, v.lists
        if any(st[0][0] == "R" or st[0][6] for st in state):
            return v.special_or_cut, v.cut_lists
        return v.special, v.special_lists

    def _fast_key(self, state: tuple):
        """A key for the string-body fast path (every alternative inside a string body at a
        character boundary, no enum), or None when it does not apply."""
        parts = []
        if any(st is None for st in state):
            return None
        for top, rest in state:
            if top[0] == "R" and not top[2]:  # a whole-output regex at a character boundary
                parts.append(top)
                continue
            if top[0] != "S" or top[3] or top[4] or top[5] or top[1].enum is not None:
                return None
            parts.append(self._body_part(top, rest))
        return ("fast", tuple(parts)) if parts else None

    def _body_part(self, top: tuple, rest) -> tuple:
        """A string body's part of its fast key: its counters clamped to the longest walked
        token (to the longest token, with patterns: the plain tokens go through them)."""
        node, count = top[1], top[2]
        cap = self.vocab.max_special if not top[6] else self._cap(top[6], self.vocab.max_chars)
        left = cap if node.max_len is None else min(node.max_len - count, cap)
        deficit = min(max(node.min_len - count, 0), cap)
        return (node, left, deficit, top[6], top[7], rest)

    def reserve(self, headroom: float, least: int) -> None:
        """Room in the C walk's table for `headroom` times the states it holds, and `least`
        (called after the compile-time warm-up: later walks add a few percent more, a small
        grammar's more than its few sampled states, and growing the table in a mask is a
        pause of up to a millisecond)."""
        tw = self._tw
        if tw:
            with self._walk_lock:
                tw.table.reserve(max(int(int(tw.table.lexrows.n[0]) * headroom) + 1, least))

    def _walker(self):
        """The TableWalker, False where the C walk is not used."""
        if self._tw is None:
            lib = c_table_walker() if self.use_c else None
            self._tw = TableWalker(self, lib) if lib is not None else False
        return self._tw

    def _walk(self, state: tuple, hist: bytes, trie: TokenTrie, lists) -> np.ndarray:
        """The tokens of `trie` allowed from `state`, packed: the C table walk where it is built."""
        self._local.read_text = True
        if self._walker():
            with self._walk_lock:  # (packed under the lock: the walker's row is its next walk's)
                out = np.packbits(self._tw.walk(state, hist, trie, lists), bitorder="little")
                self._local.read_text = self._tw.read_text  # (read under the lock: this thread's walk)
            return out
        return np.packbits(self._walk_py(state, hist, trie, lists), bitorder="little")

    def _walk_py(self, state: tuple, hist: bytes, trie: TokenTrie, lists) -> np.ndarray:
        """The Python walk (the oracle of the C walk; its fallback): bool [n_slots]."""
        out = np.zeros(self.vocab.n_slots, dtype=np.bool_)
        hits = self._walk_hits(state, hist, lists, trie.sink, 0, trie.n_nodes, b"")
        if hits:
            out[hits] = True
        for t, src in lists[4]:
            out[t] = out[src]
        return out

    def _walk_hits(self, state: tuple, hist: bytes, lists, sink: int, i0: int, i1: int, prefix: bytes) -> list:
        """Allowed tokens among trie nodes [i0, i1) (a run of subtrees below the node whose
        path is `prefix`, where the matcher is in `state`), stepping the matcher per node."""
        byte, depth, skip, tok, _ = lists
        base = len(hist)
        d0 = len(prefix)
        path = bytearray(257)
        path[:d0] = prefix

        def ctx(start: int, end: int) -> bytes:
            if end <= base:
                return hist[start:end]
            tail = bytes(path[:end - base])
            return (hist[start:] + tail) if start < base else tail[start - base:]

        advance, candidates = self.machine.advance, self.machine.candidates
        states = [None] * 258
        cands = [None] * 258  # per depth: bytes worth stepping (None: all)
        states[d0], cands[d0] = state, candidates(state)
        i = i0
        hits = []
        while i < i1:
            d = depth[i]
            b = byte[i]
            c = cands[d - 1]
            if c is not None and b not in c:
                i = skip[i]
                continue
            path[d - 1] = b
            nxt = advance(states[d - 1], b, base + d - 1, ctx)
            if not nxt:
                i = skip[i]
                continue
            states[d] = nxt
            if tok[i] != sink and self._lives(nxt, base + d, ctx, path, d):
                hits.append(tok[i])
            i += 1
            if i < i1 and depth[i] > d:  # it has children
                cands[d] = candidates(nxt)
        return hits

    def _lives(self, state: tuple, pos: int, ctx, path: bytearray, d: int) -> bool:
        """One byte of lookahead after a token: some byte (or the end) can follow, so a
        token after which every continuation fails a check (a duplicate item, a number out
        of bounds) is not offered. States whose next bytes are not a small set pass."""
        m = self.machine
        cands = m.candidates(state)
        if cands is None or m.complete(state) or m.accepting(state, pos, ctx):
            return True
        for c in cands:
            path[d] = c  # ctx reads the lookahead byte from the path
            if m.advance(state, c, pos, ctx):
                return True
        return False

    # ------------------------------------------------------------ regex tables
    def _regex_alive(self, p: int) -> np.ndarray:
        """bool [n_slots]: the whole-character plain tokens after which pattern state `p` is
        not dead, computed for all of them at once, one character position at a time, over
        a lazily filled transition table (states x character classes)."""
        with self._lock:
            got = self._alive.get(p)
        if got is not None:
            return got
        got = self._regex_walk(p)[0]
        with self._lock:
            if len(self._alive) >= MEMO_PARTS:
                self._alive.clear()
            self._alive[p] = got
        return got

    def _regex_need(self, p: int) -> np.ndarray:
        """int32 [n_slots]: the characters pattern state `p` needs at least after each plain
        token (RegexPool.min_chars of the state the token ends in; NEVER where it dies):
        `_regex_alive`'s walk again, its class steps derived by then, and run for patterns
        under maxLength only (keeping each walk's end states for every pattern would hold
        ~360 KB per pattern state, and computing them cost the other patterns' masks)."""
        with self._lock:
            got = self._needs.get(p)
        if got is not None:
            return got
        _, end, tab = self._regex_walk(p)
        mins = np.fromiter((self.machine.pool.min_chars(t) for t in tab.terms), dtype=np.int64, count=len(tab.terms))
        got = np.full(self.vocab.n_slots, NEVER, dtype=np.int32)
        got[self.vocab.whole_ids] = mins[end]
        with self._lock:
            if len(self._needs) >= MEMO_PARTS:
                self._needs.clear()
            self._needs[p] = got
        return got

    def _regex_walk(self, p: int) -> tuple:
        """(`_regex_alive`'s row, the class-table state each whole token ends in (`dead` where
        it dies), that class table)."""
        tab = self._tables()
        v = self.vocab
        lib = c_table_walker() if self.use_c else None
        if lib is not None:
            with self._walk_lock:  # (the C run marks the class table's listed steps until filled)
                return self._regex_alive_c(lib, tab, p) + (tab,)
        active = np.arange(len(v.whole_ids))
        st = np.full(len(active), tab.local(p), dtype=np.int64)
        alive_rows, ends = [], []
        for k in range(MAX_TABLE_CHARS):
            longer = v.whole_len[active] > k
            alive_rows.append(active[~longer])  # ended alive
            ends.append(st[~longer])
            active, st = active[longer], st[longer]
            if not len(active):
                break
            st = tab.next(st, np.searchsorted(tab.bounds, v.cps[active, k], side="right"))
            live = st != tab.dead
            active, st = active[live], st[live]
        alive_rows.append(active)
        ends.append(st)
        end = np.full(len(v.whole_ids), tab.dead, dtype=np.int64)
        end[np.concatenate(alive_rows)] = np.concatenate(ends)
        out = np.zeros(v.n_slots, dtype=np.bool_)
        out[v.whole_ids[np.concatenate(alive_rows)]] = True
        return out, end, tab

    def _regex_alive_c(self, lib, tab: "ClassTable", p: int) -> tuple:
        """_regex_walk's tokens walked in C (table_walk.c cfg_class_walk): the walk lists
        the class steps it lacks, Python derives them, the walk runs again until none."""
        v = self.vocab
        n = len(v.whole_ids)
        alive = np.zeros(n, dtype=np.uint8)
        end = np.zeros(n, dtype=np.int64)
        missing = np.zeros((4096, 2), dtype=np.int64)
        start, cmap = tab.local(p), tab.class_map(v)
        while True:
            m = lib.cfg_class_walk(v.cp_idx.ctypes.data, v.cp_off.ctypes.data, v.whole_lcp.ctypes.data, n,
                                   MAX_TABLE_CHARS, cmap.ctypes.data, tab.trans.ctypes.data, tab.n_classes, start,
                                   tab.dead, alive.ctypes.data, end.ctypes.data, missing.ctypes.data, len(missing))
            if m == 0:
                break
            try:
                tab.fill(missing[:m].tolist())
            finally:  # (a step that failed must not stay marked listed: -2)
                tab.trans[tab.trans == -2] = -1
        out = np.zeros(v.n_slots, dtype=np.bool_)
        out[v.whole_ids] = alive.view(np.bool_)
        return out, end

    def _tables(self) -> "ClassTable":
        pool = self.machine.pool
        n = pool.n_charsets()
        with self._lock:
            if self._table is None or self._table.version != n:
                self._table = ClassTable(pool, self.vocab, n)
            return self._table
