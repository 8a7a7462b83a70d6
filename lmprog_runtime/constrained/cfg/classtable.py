"""Code-point classes of a grammar's regex pool and the pattern transition table over them
(mask.py's vectorized walk of the plain tokens through a string pattern, `_regex_alive`)."""
from __future__ import annotations

import numpy as np


class ClassTable:
    """Code points split into classes no character set of the pool tells apart, and a
    transition table over them, filled on demand (pool.step on a class representative)."""

    def __init__(self, pool, vocab, version: int):
        self.pool, self.version = pool, version
        bounds = pool.charset_bounds()
        self.bounds = np.asarray(bounds, dtype=np.int64)
        self.reps = [0] + bounds  # class k >= 1 starts at bounds[k-1]
        self.n_classes = len(bounds) + 1
        self.terms: list[int] = []
        self.ids: dict[int, int] = {}
        self.trans = np.full((16, self.n_classes), -1, dtype=np.int64)
        self.dead = self.local(pool.NONE)
        self._cmap = None  # (class_map)

    def local(self, term: int) -> int:
        got = self.ids.get(term)
        if got is None:
            got = self.ids[term] = len(self.terms)
            self.terms.append(term)
            if got >= self.trans.shape[0]:
                grown = np.full((self.trans.shape[0] * 2, self.n_classes), -1, dtype=np.int64)
                grown[: self.trans.shape[0]] = self.trans
                self.trans = grown
        return got

    def next(self, cur: np.ndarray, cls: np.ndarray) -> np.ndarray:
        nxt = self.trans[cur, cls]
        missing = nxt < 0
        if missing.any():
            self.fill(zip(cur[missing].tolist(), cls[missing].tolist()))
            nxt = self.trans[cur, cls]
        return nxt

    def fill(self, pairs) -> None:
        """Derive the (local state, class) steps listed (pool.step on the class's first code point)."""
        for s, c in set(map(tuple, pairs)):
            if self.trans[s, c] < 0:
                term = self.pool.step(self.terms[s], self.reps[c])
                self.trans[s, c] = self.local(term)

    def class_map(self, vocab) -> np.ndarray:
        """int32: the class of each of the vocabulary's distinct code points (vocab.cp_uniq)."""
        if self._cmap is None:
            self._cmap = np.searchsorted(self.bounds, vocab.cp_uniq, side="right").astype(np.int32)
        return self._cmap
