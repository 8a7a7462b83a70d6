"""The vocabulary as a byte trie, walked against a byte DFA to get a state's token mask.

`TokenTrie(table)` is built once per tokenizer; `trie.mask(dfa, state, row)`
sets `row[t] = True` for every token whose bytes the DFA can read from `state`. The walk
runs in a small C function (trie_walk.c, compiled by `native.build` into the cache
directory at first use) and falls back to a level-by-level
numpy walk with the same result where no compiler is available.
"""
from __future__ import annotations

import ctypes
import pathlib
from typing import Optional, Sequence

import numpy as np

from lmprog_runtime import native

MAX_TOKEN_BYTES = 255  # trie depth is stored in a uint8; longer tokens are never allowed
_NODE = np.dtype([("skip", np.int32), ("tok", np.int32), ("byte", np.uint8), ("depth", np.uint8)],
                 align=True)  # matches lm_node in trie_walk.c (12 bytes)
_SOURCE = pathlib.Path(__file__).with_name("trie_walk.c")


def _declare(lib: ctypes.CDLL) -> None:
    ptr, i32 = ctypes.c_void_p, ctypes.c_int32  # raw addresses: data_as() costs ~5 us per array
    lib.lm_trie_mask.argtypes = [ptr, i32, ptr, i32, i32, i32, ptr, i32, ptr, ptr, ptr]
    lib.lm_trie_mask.restype = None


_KERNEL = native.Kernel(_SOURCE, ("-O2",), False, _declare)


def c_walker() -> Optional[ctypes.CDLL]:
    """The C walker, built once per source version; None (numpy walk) if that is impossible."""
    return _KERNEL.lib()


class TokenTrie:
    """Preorder byte trie of a vocabulary (`table[i]` = bytes of token i, or None)."""

    def __init__(self, table: Sequence[Optional[bytes]], use_c: bool = True):
        entries = sorted((b, i) for i, b in enumerate(table) if b and len(b) <= MAX_TOKEN_BYTES)
        byte, depth, parent, tok_node = [], [], [], []
        path: list[bytes] = []  # bytes of the current root->node path, one node per depth
        path_node: list[int] = []
        for data, tok in entries:
            common = 0
            while common < len(path) and common < len(data) and path[common] == data[common:common + 1]:
                common += 1
            del path[common:], path_node[common:]
            for d in range(common, len(data)):
                path.append(data[d:d + 1])
                path_node.append(len(byte))
                parent.append(path_node[-2] if d else -1)
                byte.append(data[d])
                depth.append(d + 1)
            tok_node.append((path_node[-1], tok))
        n = len(byte)
        self.n_nodes = n
        self.byte = np.asarray(byte, dtype=np.uint8)
        self.depth = np.asarray(depth, dtype=np.uint8)
        self.parent = np.asarray(parent, dtype=np.int32)
        # skip[i]: first node after i's subtree = next node whose depth <= depth[i]
        skip = np.full(n, n, dtype=np.int32)
        stack: list[int] = []
        for i in range(n):
            while stack and depth[stack[-1]] >= depth[i]:
                skip[stack.pop()] = i
            stack.append(i)
        self.skip = skip
        # one token per node; tokens repeating another token's bytes are copied after the walk
        first: dict[int, int] = {}
        dups: list[tuple[int, int]] = []
        for node, tok in tok_node:
            if node in first:
                dups.append((tok, first[node]))
            else:
                first[node] = tok
        self.sink = max((t for _, t in tok_node), default=-1) + 1  # mask slot for "no token here"
        node_tok = np.full(n, self.sink, dtype=np.int32)
        node_tok[list(first)] = list(first.values())
        self.node_tok = node_tok
        self.dup_tok = np.asarray([t for t, _ in dups], dtype=np.int32)
        self.dup_src = np.asarray([s for _, s in dups], dtype=np.int32)
        self.nodes = np.zeros(n, dtype=_NODE)
        self.nodes["skip"], self.nodes["tok"] = skip, node_tok
        self.nodes["byte"], self.nodes["depth"] = self.byte, self.depth
        self._levels = [np.nonzero(self.depth == d)[0] for d in range(1, int(self.depth.max(initial=0)) + 1)]
        self._c = c_walker() if use_c else None
        self._args = (self.n_nodes, self.nodes.ctypes.data, len(self.dup_tok),
                      self.dup_tok.ctypes.data, self.dup_src.ctypes.data)

    @property
    def uses_c(self) -> bool:
        return self._c is not None

    def mask(self, dfa, state: int, row: np.ndarray) -> None:
        """Set `row[t] = True` for each token `dfa` (a ByteDFA) can read from `state`.

        row: bool [> sink], False on entry (`row[sink]`, a scratch slot, stays False).
        """
        trans, cls = dfa.trans, dfa.byte_class
        if self._c is not None:
            assert trans.dtype == np.int32 and trans.flags.c_contiguous and cls.dtype == np.uint8
            assert row.dtype == np.bool_ and row.shape[0] > self.sink and row.flags.c_contiguous
            self._c.lm_trie_mask(trans.ctypes.data, dfa.n_classes, cls.ctypes.data, dfa.dead, state,
                                 *self._args, row.ctypes.data)
        else:
            self._mask_numpy(dfa, state, row)
        row[self.sink] = False

    def _mask_numpy(self, dfa, state, row) -> None:
        trans, n = dfa.trans, dfa.n_classes
        cls = dfa.byte_class[self.byte].astype(np.int64)
        states = np.empty(self.n_nodes, dtype=np.int64)
        for d, nodes in enumerate(self._levels):
            prev = np.full(len(nodes), state, dtype=np.int64) if d == 0 else states[self.parent[nodes]]
            states[nodes] = trans[prev * n + cls[nodes]]
        live = states != dfa.dead
        row[self.node_tok[live]] = True
        if len(self.dup_tok):
            row[self.dup_tok] = row[self.dup_src]
