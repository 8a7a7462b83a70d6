"""Token-level index: regex -> byte DFA (outlines-core) -> lazy per-state token masks.

`token_bytes(tokenizer)` maps every ordinary token id to the bytes it stands for:
byte-level BPE strings are decoded through the GPT-2 byte<->unicode table ("Ġ" is a
space), SentencePiece pieces through "▁" and `<0xHH>`. Special tokens are excluded;
EOS is allowed exactly in the DFA's accepting states (see `CompiledIndex`).
"""
from __future__ import annotations

import re
import threading
from collections import OrderedDict
from functools import lru_cache
from typing import Optional

import numpy as np
import torch

from lmprog_runtime.constrained.dfa_build import build_tables
from lmprog_runtime.constrained.trie_walk import MAX_TOKEN_BYTES, TokenTrie

_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's `bytes_to_unicode` (printable stand-ins for all 256 bytes)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _is_byte_level(pieces: list[str]) -> bool:
    return sum(p.startswith("Ġ") for p in pieces if p) > 100


def grammar_token_table(tokenizer, eos_token_ids) -> list[bytes | None]:
    """`token_bytes` with EOS as no ordinary token: a grammar allows it only as an accepting
    state's exit."""
    table = token_bytes(tokenizer)
    for e in eos_token_ids:
        if e < len(table):
            table[e] = None
    return table


def token_bytes(tokenizer) -> list[bytes | None]:
    """Bytes of each token id < len(tokenizer); None for special/unmappable tokens."""
    n = len(tokenizer)
    pieces = tokenizer.convert_ids_to_tokens(list(range(n)))
    special = set(getattr(tokenizer, "all_special_ids", []))
    added = {i: tok for tok, i in tokenizer.get_added_vocab().items()} if hasattr(tokenizer, "get_added_vocab") else {}
    inv = _unicode_to_byte()
    byte_level = _is_byte_level(pieces)
    out: list[bytes | None] = []
    for i, piece in enumerate(pieces):
        if i in special or piece is None:
            out.append(None)
        elif i in added:
            is_special = getattr(tokenizer.added_tokens_decoder.get(i), "special", False)
            out.append(None if is_special else piece.encode())
        elif byte_level:
            try:
                out.append(bytes(inv[c] for c in piece))
            except KeyError:
                out.append(None)
        else:
            m = _BYTE_PIECE.match(piece)
            out.append(bytes([int(m.group(1), 16)]) if m else piece.replace("▁", " ").encode())
    return [b if b else None for b in out]


class ByteDFA:
    """A regex's DFA over UTF-8 bytes, as a dense table (outlines-core builds it).

    States are renumbered 0..n-1 with `initial` = 0; `dead` = n is an extra absorbing
    row, so `trans[s * n_classes + byte_class[b]]` is always a valid state. outlines-core's
    index over the 256-token byte vocabulary *is* this DFA: building it costs one pass
    over 256 tokens per state instead of 49k, which is what made full-vocabulary
    indexes slow.
    """

    def __init__(self, regex: str, tables: Optional[dict] = None):
        """`tables`: `dfa_build.build_tables(regex)` when already built (e.g. by a compile
        worker); built here otherwise."""
        t = build_tables(regex) if tables is None else tables
        self.n_states = t["n_states"]
        self.dead = self.n_states
        self.byte_class = t["byte_class"]
        self._cls = self.byte_class.tolist()  # python ints for the scalar walks
        self.n_classes = t["n_classes"]
        self.trans = t["trans"]
        self.initial = 0
        self.finals = t["finals"]

    def step(self, state: int, byte: int) -> int:
        return int(self.trans[state * self.n_classes + self._cls[byte]])

    def row(self, state: int) -> np.ndarray:
        """Next state for each of the 256 byte values."""
        return self.trans[state * self.n_classes:(state + 1) * self.n_classes][self.byte_class]

    def forced_bytes(self, state: int, limit: int = 1024) -> bytes:
        """The bytes every accepted continuation from `state` starts with (compressed FSM):
        follow the single live edge while the state is not accepting."""
        out = bytearray()
        while state not in self.finals and len(out) < limit:
            nxt = self.trans[state * self.n_classes:(state + 1) * self.n_classes]
            live = np.flatnonzero(nxt != self.dead)
            if len(live) != 1:
                break
            members = np.flatnonzero(self.byte_class == live[0])
            if len(members) != 1:  # one class, several bytes: a real choice
                break
            out.append(int(members[0]))
            state = int(nxt[live[0]])
        return bytes(out)

    def walk(self, state: int, data: bytes) -> int:
        """State after reading `data` (`dead` if it leaves the language)."""
        trans, cls, n = self.trans, self._cls, self.n_classes
        for b in data:
            state = int(trans[state * n + cls[b]])
        return state


class CompiledIndex:
    """A compiled regex shared by all matchers of one grammar; caches masks per state.

    Masks are computed lazily, on the first visit of a state, by walking the
    vocabulary's byte trie against the byte DFA (see trie_walk.py), and cached (LRU).
    Invariant: `mask(state)` allows exactly the ordinary tokens whose bytes keep the
    text a prefix of the language, plus every EOS id when `state` is accepting.
    """

    MASK_CACHE_STATES = 256  # bool rows of `vocab_size` bytes each (49k tokens: 12.6 MB)

    def __init__(self, regex: str, trie: TokenTrie, table: list[bytes | None],
                 eos_token_ids: list[int], vocab_size: int, dfa: Optional[ByteDFA] = None):
        self.regex = regex
        self.dfa = ByteDFA(regex) if dfa is None else dfa
        self.trie = trie
        self.table = table
        self.eos_token_ids = list(eos_token_ids)
        self.vocab_size = vocab_size
        self.initial_state = self.dfa.initial
        self._masks: OrderedDict[int, np.ndarray] = OrderedDict()
        self._done: dict[int, bool] = {}
        self._lock = threading.Lock()

    def is_final(self, state: int) -> bool:
        return state in self.dfa.finals

    def next_state(self, state: int, token_id: int) -> int | None:
        """State after an ordinary token, or None when the token is not allowed there."""
        data = self.table[token_id] if 0 <= token_id < len(self.table) else None
        if not data or len(data) > MAX_TOKEN_BYTES:
            return None
        nxt = self.dfa.walk(state, data)
        return None if nxt == self.dfa.dead else nxt

    def fill(self, state: int, mask_row: torch.Tensor) -> None:
        """Copy the allowed-token row of `state` into `mask_row` (bool [>= vocab_size]).

        numpy does the CPU copy: it stays single-threaded (~3 us for 49k tokens), where a
        torch copy of this size fans out to the intra-op pool and stalls on a busy host.
        """
        if mask_row.device.type == "cpu" and mask_row.is_contiguous():
            self.write(state, mask_row.numpy())
            return
        row = self.mask(state)
        mask_row[: row.shape[0]].copy_(torch.from_numpy(row), non_blocking=True)

    def write(self, state: int, out: np.ndarray) -> None:
        """Overwrite the numpy bool row `out` with `state`'s mask (False past vocab_size)."""
        row = self.mask(state)
        if row.shape == out.shape:  # the usual case: one copy, no views (each op is cache-cold here)
            np.copyto(out, row)
            return
        n = min(row.shape[0], out.shape[0])
        np.copyto(out[:n], row[:n])
        if out.shape[0] > n:
            out[n:] = False

    def mask(self, state: int) -> np.ndarray:
        """bool [vocab_size] of allowed tokens at `state` (cached, do not mutate)."""
        with self._lock:
            row = self._masks.get(state)
            if row is not None:
                self._masks.move_to_end(state)
                return row
        row = np.zeros(max(self.vocab_size, len(self.table)) + 1, dtype=np.bool_)  # + the trie's sink
        self.trie.mask(self.dfa, state, row)
        row = row[: self.vocab_size]
        row[[e for e in self.eos_token_ids if e < self.vocab_size]] = self.is_final(state)
        with self._lock:
            self._masks[state] = row
            if len(self._masks) > self.MASK_CACHE_STATES:
                self._masks.popitem(last=False)
        return row

    def is_complete(self, state: int) -> bool:
        """Accepting with no ordinary continuation: only EOS may follow."""
        done = self._done.get(state)
        if done is None:
            row = self.mask(state)
            done = self.is_final(state) and int(row.sum()) == sum(
                1 for e in set(self.eos_token_ids) if e < self.vocab_size)
            self._done[state] = done
        return done
