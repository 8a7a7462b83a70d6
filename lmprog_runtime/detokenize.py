"""Incremental detokenization: the text of a growing token list at O(new tokens) per update.

Each update decodes only the new tokens together with a short window of the tokens
before them (`ids[prefix_offset:]`), and appends what that adds to the window's own
text. The window gives the tokenizer its left context (a leading-space marker, a merged
byte sequence); a decode that ends in U+FFFD is an incomplete UTF-8 sequence and waits
for the next token (the complete text before it is still returned).
"""

from __future__ import annotations

from typing import Sequence

_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, **decode_kwargs):
        self.tokenizer = tokenizer
        self.kwargs = decode_kwargs  # skip_special_tokens, spaces_between_special_tokens
        self.reset()

    def reset(self) -> None:
        self.text = ""         # the text of ids[:read_offset]
        self.prefix_offset = 0  # start of the context window for the next decode
        self.read_offset = 0    # tokens already in `text`

    def update(self, ids: Sequence[int]) -> str:
        """`decode(ids)` minus a trailing incomplete character, where `ids` extends the ids
        of the last call."""
        if len(ids) < self.read_offset:  # the tail was rewritten below what we hold
            self.reset()
        if len(ids) == self.read_offset:
            return self.text
        window = self._decode(ids[self.prefix_offset:self.read_offset])
        full = self._decode(ids[self.prefix_offset:])
        if not full.startswith(window):  # the context changed earlier text: start over, once
            self.reset()
            window, full = "", self._decode(ids)
        if full.endswith(_INCOMPLETE):  # hold these tokens until the character completes
            return self.text + full[len(window):].rstrip(_INCOMPLETE)
        self.text += full[len(window):]
        self.prefix_offset, self.read_offset = self.read_offset, len(ids)
        return self.text

    def rewind(self, n: int) -> None:
        """Tokens from index `n` on were replaced (a jump-forward): forget what covers them."""
        if n < self.read_offset:
            self.reset()

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), **self.kwargs) if ids else ""
