"""Contract between the scheduler and a grammar backend.

The scheduler only uses these names:

    backend = create_grammar_backend(name, tokenizer, vocab_size, eos_token_ids)
    fut = backend.get_future(kind, spec)        # kind: json | regex | ebnf | structural_tag
    grammar = fut.result()                      # or GrammarError
    grammar.write_bitmask(words)                # int32 bitmask row (the step's mask), overwriting it
    grammar.fill_mask(mask_row)                 # bool [vocab_size], preset False
    grammar.write_mask(np_row)                  # the same into a numpy row, overwriting it
    grammar.accept_token(token_id)              # GrammarError if illegal
    grammar.is_terminated()
    grammar.rollback(k)                         # undo the last k accepted tokens
    grammar.jump_forward_str()                  # text forced from here, or None

A step's masks travel as SGLang's / xgrammar's / llguidance's bitmask: int32
[ceil(vocab_size / 32)] per row, bit j of word w set iff token 32w + j is allowed
(`write_bitmask`; on a little-endian host its bytes are `np.packbits(row, bitorder="little")`).
The sampler applies it as it is (the Triton kernel on CUDA; on the CPU a greedy row reads
one bit of it, and only a row whose favourite is banned or a sampled row is unpacked).
Bool rows (`write_mask`) serve the drafts' verification masks.

Jump-forward needs nothing else from a backend: the scheduler tokenizes the forced text,
walks the matcher through it for the draft's masks and rolls it back
(scheduler/jump_forward.py), so every backend behind this contract gets it exactly.
`jump_and_retokenize` serves callers that commit forced text without verifying it.

A backend compiles on a thread pool and keeps an LRU cache per (kind, spec); a cache
hit returns an already-completed future holding `grammar.copy()`.
"""
from __future__ import annotations

import abc
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from lmprog_runtime.config import (GRAMMAR_COMPILE_MEMORY_MB, GRAMMAR_COMPILE_TIMEOUT_S, GRAMMAR_MAX_SPEC_BYTES,
                                   GRAMMAR_MAX_STATES)

GRAMMAR_KINDS = ("json", "regex", "ebnf", "structural_tag")


class GrammarError(ValueError):
    """A constraint could not be compiled, or a token violated it."""


@dataclass(frozen=True)
class GrammarBackendConfig:
    """Frozen knobs of a backend (see docs/constrained.md)."""

    cache_size: int = 256                  # compiled grammars kept (LRU)
    compile_workers: int = 2               # background compile threads
    # compile budget (budget.py); the defaults are the environment's, read in config.py
    compile_timeout_s: float = GRAMMAR_COMPILE_TIMEOUT_S  # a compile still running after this fails
    max_spec_bytes: int = GRAMMAR_MAX_SPEC_BYTES   # regex / schema / EBNF text
    max_states: int = GRAMMAR_MAX_STATES           # NFA positions after unrolling repetitions
    compile_memory_mb: int = GRAMMAR_COMPILE_MEMORY_MB  # data size of the compile worker; 0: in-process
    whitespace_pattern: Optional[str] = None  # None: [ \t\n\r]{0,16}
    max_recursion_depth: int = 3           # $ref recursion bound
    any_depth: int = 3                     # nesting bound of unconstrained values
    extra_properties: bool = True          # missing additionalProperties means true (the spec)
    extra_depth: int = 1                   # nesting bound of such undeclared values
    # cfg: local schema documents for remote $refs, (base URI, folder) pairs (cfg/registry.py)
    schema_remotes: tuple[tuple[str, str], ...] = ()


class Grammar(abc.ABC):
    """One request's matcher over a shared compiled grammar."""

    @abc.abstractmethod
    def copy(self) -> "Grammar":
        """A fresh matcher in the initial state sharing the compiled grammar."""

    @abc.abstractmethod
    def fill_mask(self, mask_row: torch.Tensor) -> None:
        """Set True in `mask_row` (bool [vocab_size], preset False) for allowed tokens."""

    def write_mask(self, row) -> None:
        """Overwrite the numpy bool row `row` with the allowed tokens (any prior content).
        Default: clear it and `fill_mask` a torch view."""
        row.fill(False)
        self.fill_mask(torch.from_numpy(row))

    def write_bitmask(self, words) -> None:
        """Overwrite the numpy int32 row `words` ([ceil(V / 32)], C-contiguous) with the
        allowed tokens as a bitmask: bit j of word w set iff token 32w + j is allowed (the
        bits of tokens past the backend's vocab_size are not read); the scheduler's path.
        Default: the bool row of `write_mask`, packed."""
        row = np.zeros(words.shape[0] * 32, dtype=np.bool_)
        self.write_mask(row)
        words.view(np.uint8)[:] = np.packbits(row, bitorder="little")

    @abc.abstractmethod
    def accept_token(self, token_id: int) -> None:
        """Advance by one token; GrammarError when the token is not allowed."""

    @abc.abstractmethod
    def is_terminated(self) -> bool:
        """EOS was accepted, or the output is complete (no further transitions)."""

    @abc.abstractmethod
    def rollback(self, k: int) -> None:
        """Undo the last `k` accepted tokens."""

    def jump_forward_str(self) -> Optional[str]:
        """The string the grammar forces from here, or None (default: never)."""
        return None

    def jump_and_retokenize(self, old_ids: list[int], new_ids: list[int], keep: int) -> None:
        """Reset to the state after `old_ids[:keep] + new_ids` (old_ids = tokens accepted so far)."""
        self.rollback(len(old_ids) - keep)
        for tok in new_ids:
            self.accept_token(tok)


class GrammarBackend(abc.ABC):
    """Compiles (kind, spec) pairs off the caller's thread and caches the results."""

    def __init__(self, config: GrammarBackendConfig):
        self.config = config
        self._executor = ThreadPoolExecutor(config.compile_workers, thread_name_prefix="grammar")
        self._cache: OrderedDict[tuple[str, str], Grammar] = OrderedDict()
        self._inflight: dict[tuple[str, str], Future] = {}  # compiles running, by key
        # per cached key: [compile wall seconds, cache hits since]; read by `cache_entries`
        self._entry_stats: dict[tuple[str, str], list] = {}
        self._lock = threading.Lock()

    @abc.abstractmethod
    def compile(self, kind: str, spec: str) -> Grammar:
        """Compile synchronously; raise GrammarError naming the problem."""

    def get_future(self, kind: str, spec: str) -> "Future[Grammar]":
        key = (kind, spec)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                stats = self._entry_stats.get(key)
                if stats is not None:
                    stats[1] += 1
                return _done(hit.copy())
        outer: Future = Future()
        if kind not in GRAMMAR_KINDS:
            outer.set_exception(GrammarError(f"Unknown grammar kind {kind!r}; expected one of {GRAMMAR_KINDS}"))
            return outer
        if "\x00" in spec:
            outer.set_exception(GrammarError(f"Failed to compile {kind} grammar: spec contains a NUL byte"))
            return outer
        from lmprog_runtime.constrained.budget import check_spec_size
        try:
            check_spec_size(kind, spec, self.config.max_spec_bytes)
        except GrammarError as exc:
            outer.set_exception(exc)
            return outer
        timer = threading.Timer(self.config.compile_timeout_s, _expire, (outer, kind, self.config))
        timer.daemon = True
        with self._lock:  # requests of one spec arriving together share its one compile
            inner = self._inflight.get(key)
            fresh = inner is None
            if fresh:
                inner = self._inflight[key] = self._executor.submit(self._compile_checked, kind, spec)
        if fresh:  # outside the lock: a compile already done runs the callback here, and it locks
            inner.add_done_callback(lambda f: self._finish(f, key))
        timer.start()
        inner.add_done_callback(lambda f: _hand_out(f, outer, timer))
        return outer

    def _compile_checked(self, kind: str, spec: str) -> tuple:
        """(grammar, compile wall seconds)."""
        t0 = time.perf_counter()
        try:
            return self.compile(kind, spec), time.perf_counter() - t0
        except GrammarError:
            raise
        except Exception as exc:  # noqa: BLE001 - every compile failure becomes a GrammarError
            raise GrammarError(f"Failed to compile {kind} grammar: {exc}") from exc

    def _finish(self, inner: Future, key) -> None:
        """A compile ended: cache its grammar (its waiters get copies, `_hand_out`)."""
        with self._lock:
            self._inflight.pop(key, None)
            if inner.cancelled() or inner.exception() is not None:
                return
            grammar, seconds = inner.result()
            self._cache[key] = grammar
            self._cache.move_to_end(key)
            self._entry_stats[key] = [seconds, 0]
            while len(self._cache) > self.config.cache_size:
                old, _ = self._cache.popitem(last=False)
                self._entry_stats.pop(old, None)

    def cache_entries(self, spec_chars: int = 160) -> list:
        """The compiled-grammar cache, least recently used first: [{"kind", "spec" (cut to
        `spec_chars`), "spec_bytes", "compile_s", "hits", "backend"}] (for the Inspector)."""
        with self._lock:
            items = [(k, list(self._entry_stats.get(k, (0.0, 0)))) for k in self._cache]
        return [{"kind": kind, "spec": spec[:spec_chars], "spec_bytes": len(spec.encode("utf-8", "replace")),
                 "compile_s": st[0], "hits": st[1], "backend": type(self).__name__}
                for (kind, spec), st in items]

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _done(value) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


def _hand_out(inner: Future, outer: Future, timer: threading.Timer) -> None:
    """One waiter of a compile: its own matcher (a copy) or the compile's error."""
    timer.cancel()
    if inner.cancelled():
        _settle(outer, exc=GrammarError("grammar compile cancelled (the backend shut down)"))
    elif inner.exception() is not None:
        _settle(outer, exc=inner.exception())
    else:
        _settle(outer, result=inner.result()[0].copy())


def _settle(fut: Future, result=None, exc=None) -> None:
    try:
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)
    except Exception:  # noqa: BLE001 - already settled by the timeout
        pass


def _expire(fut: Future, kind: str, config: GrammarBackendConfig) -> None:
    _settle(fut, exc=GrammarError(
        f"Failed to compile {kind} grammar: compile timed out after {config.compile_timeout_s:g} s "
        "(the compile budget, LMPROG_GRAMMAR_COMPILE_TIMEOUT)"))
