"""Token-level index: regex -> outlines-core `Index` over the tokenizer's real bytes.

`token_bytes(tokenizer)` maps every ordinary token id to the bytes it stands for:
byte-level BPE strings are decoded through the GPT-2 byte<->unicode table ("Ġ" is a
space), SentencePiece pieces through "▁" and `<0xHH>`. Special tokens are excluded;
EOS is handled by the index's final states (see `CompiledIndex`).
"""
from __future__ import annotations

import re
from collections import OrderedDict
from functools import lru_cache

import numpy as np
import outlines_core
import torch

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


def build_vocabulary(table: list[bytes | None], eos_token_id: int) -> outlines_core.Vocabulary:
    by_bytes: dict[bytes, list[int]] = {}
    for i, b in enumerate(table):
        if b is not None and i != eos_token_id:
            by_bytes.setdefault(b, []).append(i)
    return outlines_core.Vocabulary(eos_token_id, by_bytes)


class CompiledIndex:
    """A compiled regex shared by all matchers of one grammar; caches masks per state.

    Invariant: `allowed(state)` lists ordinary tokens keeping the text a prefix of the
    language, plus every EOS id when `state` is accepting.
    """

    MASK_CACHE_STATES = 512  # bool rows of `vocab_size` bytes each

    def __init__(self, regex: str, vocabulary, eos_token_ids: list[int], vocab_size: int):
        self.regex = regex
        self.index = outlines_core.Index(regex, vocabulary)
        self.eos_token_ids = list(eos_token_ids)
        self.eos_vocab_id = vocabulary.get_eos_token_id()
        self.vocab_size = vocab_size
        self.initial_state = self.index.get_initial_state()
        self._masks: OrderedDict[int, np.ndarray] = OrderedDict()
        self._done: dict[int, bool] = {}

    def is_final(self, state: int) -> bool:
        return self.index.is_final_state(state)

    def next_state(self, state: int, token_id: int):
        return self.index.get_next_state(state, token_id)

    def fill(self, state: int, mask_row: torch.Tensor) -> None:
        """Copy the allowed-token row of `state` into `mask_row` (bool [>= vocab_size]).

        numpy does the CPU copy: it stays single-threaded (~3 us for 49k tokens), where a
        torch copy of this size fans out to the intra-op pool and stalls on a busy host.
        """
        row = self.mask(state)
        if mask_row.device.type == "cpu" and mask_row.is_contiguous():
            np.copyto(mask_row.numpy()[: row.shape[0]], row)
        else:
            mask_row[: row.shape[0]].copy_(torch.from_numpy(row), non_blocking=True)

    def mask(self, state: int) -> np.ndarray:
        """bool [vocab_size] of allowed tokens at `state` (cached, do not mutate)."""
        row = self._masks.get(state)
        if row is not None:
            self._masks.move_to_end(state)
            return row
        row = np.zeros(self.vocab_size, dtype=np.bool_)
        ids = np.array(self.index.get_allowed_tokens(state) or [], dtype=np.int64)  # vectorized: ~5x faster
        row[ids[(ids < self.vocab_size) & (ids != self.eos_vocab_id)]] = True
        if self.is_final(state):
            row[[e for e in self.eos_token_ids if e < self.vocab_size]] = True
        self._masks[state] = row
        if len(self._masks) > self.MASK_CACHE_STATES:
            self._masks.popitem(last=False)
        return row

    def is_complete(self, state: int) -> bool:
        """Accepting with no ordinary continuation: only EOS may follow (read off the
        state's mask row, so a new state costs one `get_allowed_tokens`, not two)."""
        done = self._done.get(state)
        if done is None:
            row = self.mask(state)
            done = self.is_final(state) and int(row.sum()) == sum(
                1 for e in set(self.eos_token_ids) if e < self.vocab_size and row[e])
            self._done[state] = done
        return done
