"""Constrained decoding: JSON Schema -> regex -> token index, masks, jump-forward.

`create_grammar_backend` is the only entry point the scheduler needs; backends import
lazily so that `llguidance` / `xgrammar` are loaded only when chosen.
"""
from __future__ import annotations

from typing import Optional, Sequence

from lmprog_runtime.constrained.base import (GRAMMAR_KINDS, Grammar, GrammarBackend,
                                             GrammarBackendConfig, GrammarError)
from lmprog_runtime.constrained.jump_forward import jump_forward_retokenize
from lmprog_runtime.constrained.regex_fragments import UnsupportedSchemaError

_BACKENDS = {
    "outlines": ("lmprog_runtime.constrained.outlines_backend", "OutlinesBackend"),
    "cfg": ("lmprog_runtime.constrained.cfg.backend", "CfgBackend"),
    "llguidance": ("lmprog_runtime.constrained.llguidance_backend", "LLGuidanceBackend"),
    "xgrammar": ("lmprog_runtime.constrained.xgrammar_backend", "XGrammarBackend"),
}


def create_grammar_backend(name: str, tokenizer, vocab_size: int, eos_token_ids: Sequence[int],
                           whitespace_pattern: Optional[str] = None,
                           config: Optional[GrammarBackendConfig] = None) -> GrammarBackend:
    """Build the grammar backend `name` (outlines | cfg | llguidance | xgrammar)."""
    import importlib
    from dataclasses import replace

    if name not in _BACKENDS:
        raise ValueError(f"unknown grammar backend {name!r}; expected one of {sorted(_BACKENDS)}")
    config = config or GrammarBackendConfig()
    if whitespace_pattern is not None:
        config = replace(config, whitespace_pattern=whitespace_pattern)
    module, cls = _BACKENDS[name]
    return getattr(importlib.import_module(module), cls)(tokenizer, vocab_size, list(eos_token_ids), config)


def create_serving_backend(name: str, tokenizer, vocab_size: int, eos_token_ids: Sequence[int],
                           whitespace_pattern: Optional[str] = None):
    """The scheduler's backend: `name` for every kind, except EBNF and structural tags, which
    go to xgrammar (built on the first such request) unless `name` is xgrammar itself, or
    `name` is cfg, which reads EBNF (structural tags still go to xgrammar; routed.py)."""
    from lmprog_runtime.constrained.routed import RoutedBackend

    primary = create_grammar_backend(name, tokenizer, vocab_size, eos_token_ids, whitespace_pattern)
    if name == "xgrammar":
        return primary
    kinds = ("structural_tag",) if name == "cfg" else ("ebnf", "structural_tag")  # cfg reads EBNF itself
    return RoutedBackend(primary, lambda: create_grammar_backend("xgrammar", tokenizer, vocab_size, eos_token_ids,
                                                                  whitespace_pattern), kinds)


__all__ = ["create_grammar_backend", "create_serving_backend", "Grammar", "GrammarBackend", "GrammarBackendConfig", "GrammarError",
           "GRAMMAR_KINDS", "UnsupportedSchemaError", "jump_forward_retokenize"]
