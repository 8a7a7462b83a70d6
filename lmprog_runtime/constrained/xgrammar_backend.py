"""Adapter: xgrammar (json / regex / ebnf / structural_tag) behind the same Grammar contract.

Imported only when `create_grammar_backend("xgrammar", ...)` is called.
"""
from __future__ import annotations

import json
from typing import Optional, Sequence

import torch

from lmprog_runtime.constrained.base import Grammar, GrammarBackend, GrammarBackendConfig, GrammarError
from lmprog_runtime.constrained.bitmask import copy_words as _copy_words, unpack_into

try:
    import xgrammar as xgr
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("the xgrammar grammar backend needs `pip install xgrammar` "
                      "(or `pip install lmprog[xgrammar]`)") from exc


class XGrammarGrammar(Grammar):
    def __init__(self, ctx, vocab_size: int):
        self._ctx, self._vocab_size = ctx, vocab_size
        self.matcher = xgr.GrammarMatcher(ctx, max_rollback_tokens=200)
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self.finished = False

    @property
    def state(self):
        return id(self.matcher)

    def copy(self) -> "XGrammarGrammar":
        return XGrammarGrammar(self._ctx, self._vocab_size)

    def fill_mask(self, mask_row: torch.Tensor) -> None:
        self.matcher.fill_next_token_bitmask(self._bitmask, 0)
        unpack_into(self._bitmask[0], mask_row, self._vocab_size)

    def write_bitmask(self, words) -> None:
        """xgrammar fills our layout itself: straight into the row where it has the
        bitmask's width, else into its own and copied."""
        if words.shape[0] == self._bitmask.shape[1]:
            self.matcher.fill_next_token_bitmask(torch.from_numpy(words)[None], 0)
            return
        self.matcher.fill_next_token_bitmask(self._bitmask, 0)
        _copy_words(self._bitmask[0].numpy(), words)

    def accept_token(self, token_id: int) -> None:
        if not self.matcher.accept_token(token_id):
            raise GrammarError(f"token {token_id} is not allowed here")
        self.finished = self.matcher.is_terminated()

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def rollback(self, k: int) -> None:
        self.matcher.rollback(k)
        self.finished = False

    def jump_forward_str(self) -> Optional[str]:
        return self.matcher.find_jump_forward_string() or None


class XGrammarBackend(GrammarBackend):
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int],
                 config: GrammarBackendConfig = GrammarBackendConfig()):
        super().__init__(config)
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(eos_token_ids))
        self.compiler = xgr.GrammarCompiler(info)

    def compile(self, kind: str, spec: str) -> XGrammarGrammar:
        try:
            if kind == "json":
                ctx = (self.compiler.compile_builtin_json_grammar() if spec.strip() == "$$ANY$$"
                       else self.compiler.compile_json_schema(spec, any_whitespace=True))
            elif kind == "regex":
                ctx = self.compiler.compile_regex(spec)
            elif kind == "ebnf":
                ctx = self.compiler.compile_grammar(spec)
            elif kind == "structural_tag":
                ctx = self._compile_structural_tag(spec)
            else:
                raise ValueError(f"{kind} grammars are not supported by the xgrammar backend")
        except Exception as exc:  # noqa: BLE001
            raise GrammarError(f"Failed to compile {kind} grammar: {exc}") from exc
        return XGrammarGrammar(ctx, self.vocab_size)

    def _compile_structural_tag(self, spec: str):
        """SGLang's legacy form {"structures": [{"begin", "schema", "end"}], "triggers": [...]},
        or xgrammar's {"format": {...}} (with or without "type": "structural_tag")."""
        tag = json.loads(spec)
        if not isinstance(tag, dict):
            raise ValueError("a structural tag is a JSON object")
        if "structures" in tag:
            items = [xgr.StructuralTagItem(begin=s["begin"], schema=s["schema"], end=s["end"])
                     for s in tag["structures"]]
            return self.compiler.compile_structural_tag(items, list(tag.get("triggers") or []))
        return self.compiler.compile_structural_tag({**tag, "type": "structural_tag"})
