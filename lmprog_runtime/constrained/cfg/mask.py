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

import threading
from collections import OrderedDict
from typing import Optional, Sequence

import numpy as np

from lmprog_runtime.constrained.cfg.machine import Machine, utf8_start
from lmprog_runtime.constrained.trie_walk import TokenTrie

MEMO_STATES = 4096  # cached masks per compiled grammar (LRU)


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
                special[i] = data
            else:
                plain[i], chars[i] = True, n
        self.plain, self.chars = plain, chars
        self.special = TokenTrie(special, use_c=False)
        self.max_chars = max((len(b) for b in table if b), default=1) + 1
        self.lists = _lists(self.trie)
        self.special_lists = _lists(self.special)


def _lists(trie: TokenTrie):
    return (trie.byte.tolist(), trie.depth.tolist(), trie.skip.tolist(), trie.node_tok.tolist(),
            list(zip(trie.dup_tok.tolist(), trie.dup_src.tolist())))


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


class MaskEngine:
    def __init__(self, machine: Machine, vocab: VocabInfo):
        self.machine, self.vocab = machine, vocab
        self._memo: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def mask(self, state: tuple, hist: bytes) -> np.ndarray:
        key = self._fast_key(state)
        memo_key = key if key is not None else state
        with self._lock:
            got = self._memo.get(memo_key)
            if got is not None:
                self._memo.move_to_end(memo_key)
        if got is None:
            if key is not None:
                got = self._walk(state, hist, self.vocab.special, self.vocab.special_lists)
            else:
                got = self._walk(state, hist, self.vocab.trie, self.vocab.lists)
            with self._lock:
                self._memo[memo_key] = got
                while len(self._memo) > MEMO_STATES:
                    self._memo.popitem(last=False)
        if key is None:
            return got
        node, count = state[0][0][1], state[0][0][2]
        out = self.vocab.plain.copy()
        if node.max_len is not None:
            out &= self.vocab.chars <= node.max_len - count
        out |= got
        return out

    def _fast_key(self, state: tuple):
        """A key for the string-body fast path, or None when it does not apply."""
        if len(state) != 1:
            return None
        top, rest = state[0]
        if top[0] != "S" or top[3] or top[4] or top[5] or top[6] or top[1].enum is not None:
            return None
        node, count, cap = top[1], top[2], self.vocab.max_chars
        left = cap if node.max_len is None else min(node.max_len - count, cap)
        deficit = min(max(node.min_len - count, 0), cap)
        return ("fast", node, left, deficit, top[7], rest)

    def _walk(self, state: tuple, hist: bytes, trie: TokenTrie, lists) -> np.ndarray:
        byte, depth, skip, tok, dups = lists
        out = np.zeros(self.vocab.n_slots, dtype=np.bool_)
        base = len(hist)
        path = bytearray(256)

        def ctx(start: int, end: int) -> bytes:
            if end <= base:
                return hist[start:end]
            tail = bytes(path[:end - base])
            return (hist[start:] + tail) if start < base else tail[start - base:]

        advance = self.machine.advance
        states = [state] + [None] * 256
        i, n, sink = 0, trie.n_nodes, trie.sink
        hits = []
        while i < n:
            d = depth[i]
            b = byte[i]
            path[d - 1] = b
            nxt = advance(states[d - 1], b, base + d - 1, ctx)
            if not nxt:
                i = skip[i]
                continue
            states[d] = nxt
            if tok[i] != sink:
                hits.append(tok[i])
            i += 1
        if hits:
            out[hits] = True
        for t, src in dups:
            out[t] = out[src]
        return out
