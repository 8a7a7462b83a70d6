"""Grammar backend "outlines": our JSON Schema translation, outlines-core's byte DFA, and a
lazy token index over the tokenizer's real bytes (index.py, trie_walk.py)."""
from __future__ import annotations

import threading
import weakref
from typing import Optional, Sequence

import torch

from lmprog_runtime.constrained.budget import check_regex_budget
from lmprog_runtime.constrained.base import Grammar, GrammarBackend, GrammarBackendConfig, GrammarError
from lmprog_runtime.constrained.dfa_build import IsolatedBuilder
from lmprog_runtime.constrained.index import ByteDFA, CompiledIndex, grammar_token_table
from lmprog_runtime.constrained.json_schema import build_regex_from_schema
from lmprog_runtime.constrained.regex_fragments import ascii_shorthands
from lmprog_runtime.constrained.trie_walk import TokenTrie

ANY_JSON = "$$ANY$$"  # SGLang's spelling of "any JSON value"


class _Shared:
    """What every matcher of one compiled grammar shares: the index and its forced strings."""

    def __init__(self, index: CompiledIndex):
        self.index = index
        self._forced: dict[int, Optional[str]] = {}
        self._lock = threading.Lock()

    def forced_string(self, state: int) -> Optional[str]:
        """Jump-forward text from a DFA state (cached): the forced bytes cut to whole
        UTF-8 characters; None when `state` sits inside a character."""
        with self._lock:
            if state in self._forced:
                return self._forced[state]
        data = self.index.dfa.forced_bytes(state)
        text: Optional[str] = None
        if data and not 0x80 <= data[0] < 0xC0:  # a continuation byte: the next token must finish it
            for cut in range(len(data), max(len(data) - 4, 0), -1):
                try:
                    text = data[:cut].decode("utf-8")
                    break
                except UnicodeDecodeError:
                    continue
        with self._lock:
            self._forced[state] = text or None
        return text or None


class OutlinesGrammar(Grammar):
    """Matcher: a stack of index states, one per accepted token (rollback = pop)."""

    def __init__(self, shared: _Shared):
        self._shared = shared
        self._states: list[int] = [shared.index.initial_state]
        self._ids: list[int] = []
        self.finished = False  # EOS accepted

    @property
    def state(self) -> int:
        return self._states[-1]

    def copy(self) -> "OutlinesGrammar":
        return OutlinesGrammar(self._shared)

    def fill_mask(self, mask_row: torch.Tensor) -> None:
        index = self._shared.index
        if self.finished:
            for e in index.eos_token_ids:
                if e < mask_row.shape[0]:
                    mask_row[e] = True
            return
        index.fill(self.state, mask_row)

    def write_mask(self, row) -> None:
        index = self._shared.index
        if self.finished:
            row.fill(False)
            row[[e for e in index.eos_token_ids if e < row.shape[0]]] = True
            return
        index.write(self.state, row)

    def accept_token(self, token_id: int) -> None:
        index = self._shared.index
        if self.finished:
            raise GrammarError(f"token {token_id} after the grammar accepted EOS")
        if token_id in index.eos_token_ids:
            if not index.is_final(self.state):
                raise GrammarError(f"EOS token {token_id} before the output is complete")
            self.finished = True
            nxt = self.state
        else:
            nxt = index.next_state(self.state, token_id)
            if nxt is None:
                raise GrammarError(f"token {token_id} ({self._bytes(token_id)!r}) is not allowed here")
        self._states.append(nxt)
        self._ids.append(token_id)

    def is_terminated(self) -> bool:
        return self.finished or self._shared.index.is_complete(self.state)

    def rollback(self, k: int) -> None:
        assert 0 <= k <= len(self._ids), f"rollback({k}) with {len(self._ids)} accepted tokens"
        if k == 0:
            return
        del self._states[-k:]
        del self._ids[-k:]
        self.finished = False

    # ---------------------------------------------------------------- jump-forward
    def _bytes(self, token_id: int) -> bytes:
        table = self._shared.index.table
        return (table[token_id] or b"") if token_id < len(table) else b""

    def jump_forward_str(self) -> Optional[str]:
        if self.is_terminated():
            return None
        return self._shared.forced_string(self.state)

    def jump_and_retokenize(self, old_ids: Sequence[int], new_ids: Sequence[int], keep: int) -> None:
        assert list(old_ids) == self._ids[: len(old_ids)], "old_ids must be the accepted tokens"
        self.rollback(len(self._ids) - keep)
        for tok in new_ids:
            self.accept_token(tok)


class OutlinesBackend(GrammarBackend):
    """Regex / JSON Schema grammars; EBNF and structural tags are refused."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int],
                 config: GrammarBackendConfig = GrammarBackendConfig()):
        super().__init__(config)
        if not eos_token_ids:
            raise ValueError("eos_token_ids must name at least one token")
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.table = grammar_token_table(tokenizer, self.eos_token_ids)
        self.trie = TokenTrie(self.table)
        self._builder = IsolatedBuilder()
        weakref.finalize(self, self._builder.close)  # no worker outlives its backend

    def shutdown(self) -> None:
        super().shutdown()
        self._builder.close()

    def to_regex(self, kind: str, spec: str) -> str:
        if kind == "regex":
            return spec
        if kind == "json":
            cfg = self.config
            schema = True if spec.strip() == ANY_JSON else spec
            try:
                return build_regex_from_schema(schema, cfg.whitespace_pattern,
                                               max_recursion_depth=cfg.max_recursion_depth,
                                               any_depth=cfg.any_depth, extra_properties=cfg.extra_properties,
                                               extra_depth=cfg.extra_depth)
            except ValueError as exc:
                raise GrammarError(f"Failed to compile json grammar: {exc}") from exc
        raise GrammarError(f"Failed to compile {kind} grammar: {kind} grammars are not supported by the "
                           "outlines backend (use the llguidance or xgrammar backend)")

    def compile(self, kind: str, spec: str) -> OutlinesGrammar:
        regex = ascii_shorthands(self.to_regex(kind, spec))
        check_regex_budget(kind, regex, self.config.max_states)
        cfg = self.config
        try:
            tables = None
            if cfg.compile_memory_mb > 0:  # the DFA is built in a capped, killable worker
                tables = self._builder.build(regex, cfg.compile_timeout_s, cfg.compile_memory_mb)
            dfa = ByteDFA(regex, tables)
            index = CompiledIndex(regex, self.trie, self.table, self.eos_token_ids, self.vocab_size, dfa=dfa)
        except Exception as exc:  # noqa: BLE001 - outlines-core raises plain ValueError/RuntimeError
            raise GrammarError(f"Failed to compile {kind} grammar: {exc}") from exc
        return OutlinesGrammar(_Shared(index))
