"""Key closes registered for the C table walk (table_walk.c `cfg_keys`).

A key's text is abstracted in the table's states (FREE), so the quote closing a key is a
PYTHON transition; the state it leads to depends on the text. Each one derived in Python
is registered here under (state id inside the key, the key's UTF-8 text), in an
open-addressing hash table the C walk reads: the walk assembles the text from the path
(and the root key's text) and finds the next state without returning to Python.
"""
from __future__ import annotations

import ctypes

import numpy as np

_FNV_OFFSET, _FNV_PRIME, _MASK = 1469598103934665603, 1099511628211, (1 << 64) - 1

HEAD_ESCAPED = -2  # head_len: the root is right after a backslash (table_walk.c CFG_HEAD_ESCAPED)


class CfgKeys(ctypes.Structure):
    """Mirrors cfg_keys in table_walk.c."""

    _fields_ = [("table", ctypes.c_void_p), ("cap", ctypes.c_int64), ("pool", ctypes.c_void_p),
                ("inside", ctypes.c_void_p), ("head", ctypes.c_void_p), ("head_len", ctypes.c_int64),
                ("generic", ctypes.c_void_p)]


def key_hash(state: int, text: bytes) -> int:
    """FNV-1a over the state id's 4 little-endian bytes, then the text (as table_walk.c)."""
    h = _FNV_OFFSET
    for c in (state & 0xFFFFFFFF).to_bytes(4, "little") + text:
        h = ((h ^ c) * _FNV_PRIME) & _MASK
    return h


class KeyCloses:
    """(state id, key text) -> state id after the closing quote (or DEAD), for the C walk."""

    def __init__(self):
        self.struct = CfgKeys()
        self._head = np.zeros(1, dtype=np.uint8)
        self.clear()

    def clear(self) -> None:
        self.n = 0
        self.cap = 1024
        self.table = np.full((self.cap, 4), -1, dtype=np.int64)  # hash, p << 32 | id, offset, length
        self.pool = np.zeros(4096, dtype=np.uint8)
        self.used = 0
        self.struct.table, self.struct.cap = self.table.ctypes.data, self.cap
        self.struct.pool = self.pool.ctypes.data

    def set_inside(self, inside: np.ndarray, generic: np.ndarray) -> None:
        """inside: uint8 [n_states], generic: int32 [n_states] (the table's arrays; set again
        when they grow)."""
        self.struct.inside, self.struct.generic = inside.ctypes.data, generic.ctypes.data

    def set_head(self, head, escaped: bool = False) -> None:
        """The walk root's key text (bytes), or None when the root is not inside a key (in
        plain mode); `escaped`: the root is a string body right after a backslash."""
        if head is None:
            self.struct.head_len = HEAD_ESCAPED if escaped else -1
            return
        self._head = np.frombuffer(head + b"\0", dtype=np.uint8).copy()
        self.struct.head, self.struct.head_len = self._head.ctypes.data, len(head)

    def add(self, state: int, text: bytes, t: int) -> None:
        """Register (state, text) -> t (t UNKNOWN: the C walk asks Python); an entry already
        there is overwritten."""
        h = key_hash(state, text)
        slot = self._find(h, state, text)
        if slot is not None:
            self.table[slot, 1] = (state << 32) | (t & 0xFFFFFFFF)
            return
        if 2 * (self.n + 1) > self.cap:
            self._grow()
        if self.used + len(text) > len(self.pool):
            self.pool = np.concatenate([self.pool, np.zeros(max(len(self.pool), len(text)), dtype=np.uint8)])
            self.struct.pool = self.pool.ctypes.data
        memoryview(self.pool)[self.used:self.used + len(text)] = text
        self._put(h, (state << 32) | (t & 0xFFFFFFFF), self.used, len(text))
        self.used += len(text)
        self.n += 1

    def _find(self, h: int, state: int, text: bytes):
        """The slot holding (state, text), or None."""
        signed = h - (1 << 64) if h >= 1 << 63 else h
        slot = h & (self.cap - 1)
        while self.table[slot, 3] >= 0:
            e = self.table[slot]
            if e[0] == signed and e[3] == len(text) and e[1] >> 32 == state:
                if self.pool[e[2]:e[2] + e[3]].tobytes() == text:
                    return slot
            slot = (slot + 1) & (self.cap - 1)
        return None

    def _put(self, h: int, value: int, offset: int, length: int) -> None:
        slot = h & (self.cap - 1)
        while self.table[slot, 3] >= 0:
            slot = (slot + 1) & (self.cap - 1)
        self.table[slot] = (h - (1 << 64) if h >= 1 << 63 else h, value, offset, length)

    def _grow(self) -> None:
        old = self.table[self.table[:, 3] >= 0]
        self.cap *= 2
        self.table = np.full((self.cap, 4), -1, dtype=np.int64)
        rows: list = [None] * self.cap  # (probed in a Python list: numpy element access per probe is slow)
        for entry in old.tolist():
            slot = entry[0] & (self.cap - 1)  # (h's low bits: the same for its signed form)
            while rows[slot] is not None:
                slot = (slot + 1) & (self.cap - 1)
            rows[slot] = entry
        slots = [k for k, entry in enumerate(rows) if entry is not None]
        if slots:
            self.table[slots] = [rows[k] for k in slots]
        self.struct.table, self.struct.cap = self.table.ctypes.data, self.cap
