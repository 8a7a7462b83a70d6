"""Adapter: llguidance (json / regex / ebnf-lark) behind the same Grammar contract.

Imported only when `create_grammar_backend("llguidance", ...)` is called.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from lmprog_runtime.constrained.base import Grammar, GrammarBackend, GrammarBackendConfig, GrammarError
from lmprog_runtime.constrained.bitmask import copy_words as _copy_words, unpack_into

try:
    import llguidance
    import llguidance.hf
    import llguidance.torch as llg_torch
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("the llguidance grammar backend needs `pip install llguidance` "
                      "(or `pip install lmprog[llguidance]`)") from exc


class LLGuidanceGrammar(Grammar):
    def __init__(self, ll_tokenizer, grammar: str, vocab_size: int, eos_token_ids: Sequence[int]):
        self._tok, self._grammar, self._vocab_size = ll_tokenizer, grammar, vocab_size
        self._eos = list(eos_token_ids)
        self.matcher = llguidance.LLMatcher(ll_tokenizer, grammar)
        self._bitmask = llg_torch.allocate_token_bitmask(1, ll_tokenizer.vocab_size)
        self.finished = False

    @property
    def state(self):
        return id(self.matcher)

    def copy(self) -> "LLGuidanceGrammar":
        return LLGuidanceGrammar(self._tok, self._grammar, self._vocab_size, self._eos)

    def fill_mask(self, mask_row: torch.Tensor) -> None:
        llg_torch.fill_next_token_bitmask(self.matcher, self._bitmask, 0)
        unpack_into(self._bitmask[0], mask_row, min(self._tok.vocab_size, self._vocab_size))

    def write_bitmask(self, words) -> None:
        """llguidance fills our layout itself: straight into the row where it has the
        bitmask's width, else into its own and copied."""
        if words.shape[0] == self._bitmask.shape[1]:
            llg_torch.fill_next_token_bitmask(self.matcher, torch.from_numpy(words)[None], 0)
            return
        llg_torch.fill_next_token_bitmask(self.matcher, self._bitmask, 0)
        _copy_words(self._bitmask[0].numpy(), words)

    def accept_token(self, token_id: int) -> None:
        if not self.matcher.consume_token(token_id) or self.matcher.is_error():
            raise GrammarError(f"token {token_id} is not allowed here: {self.matcher.get_error()}")
        self.finished = self.matcher.is_stopped()

    def is_terminated(self) -> bool:
        return self.matcher.is_stopped()

    def rollback(self, k: int) -> None:
        self.matcher.rollback(k)
        self.finished = False

    def jump_forward_str(self) -> Optional[str]:
        data = self.matcher.compute_ff_bytes()
        try:
            return data.decode("utf-8") or None
        except UnicodeDecodeError:
            return None


class LLGuidanceBackend(GrammarBackend):
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int],
                 config: GrammarBackendConfig = GrammarBackendConfig()):
        super().__init__(config)
        self.vocab_size, self.eos_token_ids = vocab_size, list(eos_token_ids)
        self.ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)

    def compile(self, kind: str, spec: str) -> LLGuidanceGrammar:
        M = llguidance.LLMatcher
        try:
            if kind == "json":
                grammar = M.grammar_from_json_schema(spec if spec.strip() != "$$ANY$$" else "{}",
                                                     defaults={"whitespace_flexible": True})
            elif kind == "regex":
                grammar = M.grammar_from_regex(spec)
            elif kind == "ebnf":
                grammar = M.grammar_from_lark(spec)
            else:
                raise ValueError(f"{kind} grammars are not supported by the llguidance backend")
            is_error, messages = M.validate_grammar_with_warnings(grammar, self.ll_tokenizer)
        except Exception as exc:  # noqa: BLE001
            raise GrammarError(f"Failed to compile {kind} grammar: {exc}") from exc
        if is_error:
            raise GrammarError(f"Failed to compile {kind} grammar: {'; '.join(messages)}")
        return LLGuidanceGrammar(self.ll_tokenizer, grammar, self.vocab_size, self.eos_token_ids)
