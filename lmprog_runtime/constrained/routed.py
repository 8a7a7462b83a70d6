"""EBNF grammars and structural tags go to the backend made for them (EBNF stays with the
cfg engine when it is `--grammar-backend`, which reads GBNF itself).

`ebnf` is SGLang's GBNF dialect and `structural_tag` SGLang's / xgrammar's tag format, both
of which xgrammar reads; the outlines backend (regex and JSON schema through our own
translation) has neither, and llguidance reads Lark. So a `RoutedBackend` sends these kinds
to an xgrammar backend built on the first such request and everything else to the
configured one. Both produce `Grammar`s under one contract
(base.py), so masks and jump-forward take the same path for every kind.
"""
from __future__ import annotations

from concurrent.futures import Future
from typing import Callable, Optional, Tuple

from lmprog_runtime.constrained.base import GrammarBackend, GrammarError

ROUTED_KINDS = ("ebnf", "structural_tag")


class RoutedBackend:
    def __init__(self, primary: GrammarBackend, make_secondary: Callable[[], GrammarBackend],
                 kinds: Tuple[str, ...] = ROUTED_KINDS):
        self.primary = primary
        self._make_secondary = make_secondary
        self.secondary: Optional[GrammarBackend] = None
        self.kinds = kinds

    @property
    def config(self):
        return self.primary.config

    def get_future(self, kind: str, spec: str) -> Future:
        if kind not in self.kinds:
            return self.primary.get_future(kind, spec)
        if self.secondary is None:
            try:
                self.secondary = self._make_secondary()
            except Exception as exc:  # e.g. xgrammar not installed
                fut: Future = Future()
                fut.set_exception(GrammarError(f"Failed to compile {kind} grammar: the {kind} backend "
                                               f"(xgrammar) could not start: {exc}"))
                return fut
        return self.secondary.get_future(kind, spec)

    def cache_entries(self) -> list:
        second = self.secondary.cache_entries() if self.secondary is not None else []
        return self.primary.cache_entries() + second

    def shutdown(self) -> None:
        self.primary.shutdown()
        if self.secondary is not None:
            self.secondary.shutdown()
