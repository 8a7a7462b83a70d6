"""Grammar backend "cfg": JSON Schema, regex and EBNF through one grammar engine (this package).

compile: schema -> value grammar (schema.py) or pattern -> lazy regex (regex.py), both
matched by one pushdown machine (machine.py) whose token masks come from walking the
vocabulary trie (mask.py); EBNF (GBNF) has its own recognizer with the same interface
(ebnf.py). A compiled grammar is shared by every matcher made from it (`copy()`), together
with its mask cache. Structural tags are refused here (the serving path routes them to
xgrammar, routed.py).
"""
from __future__ import annotations

import json
import logging
import threading
import time
from typing import Optional, Sequence

import numpy as np
import torch
from jsonschema.exceptions import best_match
from jsonschema.validators import Draft202012Validator, validator_for

from lmprog_runtime.constrained.base import Grammar, GrammarBackend, GrammarBackendConfig, GrammarError
from lmprog_runtime.constrained.cfg.dialect import (apply_vocabularies, dependencies_compat, id_dialect, inferred_dialect,
                                                    older_keywords, ref_siblings, whole_integers)
from lmprog_runtime.constrained.cfg.ebnf import EbnfMachine
from lmprog_runtime.constrained.cfg.machine import Machine
from lmprog_runtime.constrained.cfg.mask import MaskEngine, VocabInfo
from lmprog_runtime.constrained.cfg.regex import RegexError, RegexPool
from lmprog_runtime.constrained.cfg.regex_parse import compile_pattern
from lmprog_runtime.constrained.cfg.registry import SchemaRegistry
from lmprog_runtime.constrained.cfg.schema import SchemaCompiler
from lmprog_runtime.constrained.cfg.untrack import untrack
from lmprog_runtime.constrained.cfg.warmup import SampleTokenizer, warm
from lmprog_runtime.constrained.index import grammar_token_table
from lmprog_runtime.constrained.json_schema import DEFAULT_MAX_WHITESPACE, whitespace_regex
from lmprog_runtime.constrained.regex_fragments import UnsupportedSchemaError

logger = logging.getLogger(__name__)

ANY_JSON = "$$ANY$$"  # SGLang's spelling of "any JSON value"
MAX_FORCED_BYTES = 256
# the top frames that may end the output (Machine.accepting: a done document, a nullable regex,
# a number at the root; an EBNF state of one alternative, not None, never does)
_MAY_END = frozenset(("D", "R", "N"))
MAX_REGEX_TERMS = 1_000_000  # lazily derived regex states per grammar (memory bound)
MAX_KEY_RULES = 1 << 16  # undeclared keys' member rules memoized per grammar (emptied past it)
TABLE_HEADROOM = 1.25  # mask table room after the warm-up, times its states (dev corpus: requests add <10%)
TABLE_LEAST = 256     # ... and at least this many states (256 KB; a small schema's walks double its sample's)


class _Compiled:
    """What every matcher of one grammar shares."""

    def __init__(self, machine: Machine, engine: MaskEngine, table, eos: Sequence[int], vocab_size: int):
        self.machine, self.engine, self.table = machine, engine, table
        self.eos, self.vocab_size = list(eos), vocab_size
        self._eos_bits: dict = {}  # bytes of a bitmask row -> its EOS tokens' (byte, bit) pairs

    def eos_bits(self, m: int) -> list:
        got = self._eos_bits.get(m)
        if got is None:
            got = self._eos_bits[m] = [(e >> 3, 1 << (e & 7)) for e in self.eos if e < m * 8]
        return got


class CfgGrammar(Grammar):
    """Matcher: a stack of parse states, one per accepted token (rollback = pop)."""

    def __init__(self, shared: _Compiled):
        self._shared = shared
        self._states: list[tuple] = [shared.machine.initial()]
        self._ends: list[int] = [0]  # output byte length after each accepted token
        self._hist = bytearray()
        self.finished = False

    @property
    def state(self) -> tuple:
        return self._states[-1]

    def copy(self) -> "CfgGrammar":
        return CfgGrammar(self._shared)

    def _ctx(self, pending: bytes):
        hist = bytes(self._hist) + pending
        return lambda start, end: hist[start:end]

    def _accepting(self) -> bool:
        hist = self._hist  # (read only where a number ending the output completes a check: no copy per mask)
        return self._shared.machine.accepting(self.state, len(hist), lambda start, end: bytes(hist[start:end]))

    def fill_mask(self, mask_row: torch.Tensor) -> None:
        if mask_row.device.type == "cpu" and mask_row.is_contiguous():
            self._or_into(mask_row.numpy())
            return
        row = np.zeros(mask_row.shape[0], dtype=np.bool_)
        self._or_into(row)
        mask_row |= torch.from_numpy(row).to(mask_row.device)

    def write_mask(self, row) -> None:
        self._or_into(row, overwrite=True)

    def write_bitmask(self, words) -> None:
        sh, out = self._shared, words.view(np.uint8)
        if self.finished:
            out.fill(0)
        else:
            state = self._states[-1]
            sh.engine.write_words(state, self._hist, out)  # (hist copied only off a memo hit)
            if (len(state) == 1 and state[0] is not None and state[0][0][0] not in _MAY_END) or not self._accepting():
                return
        for i, bit in sh.eos_bits(out.shape[0]):
            out[i] |= bit

    def _or_into(self, row: np.ndarray, overwrite: bool = False) -> None:
        """Set the allowed tokens True in the numpy bool row (others untouched, or False
        with `overwrite`)."""
        sh = self._shared
        if self.finished:
            if overwrite:
                row.fill(False)
        else:
            sh.engine.write_row(self.state, bytes(self._hist), row, overwrite)
        if self.finished or self._accepting():
            for e in sh.eos:
                if e < row.shape[0]:
                    row[e] = True

    def accept_token(self, token_id: int) -> None:
        sh = self._shared
        if self.finished:
            raise GrammarError(f"token {token_id} after the grammar accepted EOS")
        if token_id in sh.eos:
            if not self._accepting():
                raise GrammarError(f"EOS token {token_id} before the output is complete")
            self.finished = True
            self._states.append(self.state)
            self._ends.append(len(self._hist))
            return
        data = sh.table[token_id] if 0 <= token_id < len(sh.table) else None
        if not data:
            raise GrammarError(f"token {token_id} is not allowed here (no text)")
        state, base, ctx = self.state, len(self._hist), self._ctx(data)
        for k, b in enumerate(data):
            state = sh.machine.advance(state, b, base + k, ctx)
            if not state:
                raise GrammarError(f"token {token_id} ({data!r}) is not allowed here")
        self._hist += data
        untrack(state)  # (its new frames: the stack below was the last state's, untracked then; untrack.py)
        self._states.append(state)
        self._ends.append(len(self._hist))

    def is_terminated(self) -> bool:
        return self.finished or self._shared.machine.complete(self.state)

    def rollback(self, k: int) -> None:
        assert 0 <= k < len(self._states), f"rollback({k}) with {len(self._states) - 1} accepted tokens"
        if k == 0:
            return
        del self._states[-k:]
        del self._ends[-k:]
        del self._hist[self._ends[-1]:]
        self.finished = False

    def jump_forward_str(self) -> Optional[str]:
        """The bytes every continuation starts with (one live byte at a time, stopping where
        the output could end; `\\` escapes, which only respell a character, do not count as
        a choice), cut to whole UTF-8 characters."""
        if self.is_terminated():
            return None
        m, state, out = self._shared.machine, self.state, bytearray()
        base = len(self._hist)
        while len(out) < MAX_FORCED_BYTES:
            ctx = self._ctx(bytes(out) + b"\x00")
            if m.accepting(state, base + len(out), ctx):
                break
            step = _forced_byte(m, state, base + len(out), ctx)
            if step is None:
                break
            out.append(step[0])
            state = step[1]
        return whole_characters(out)


def whole_characters(out: bytes) -> Optional[str]:
    """Forced bytes cut to whole UTF-8 characters (None when nothing is left or they start
    inside a character)."""
    if not out or 0x80 <= out[0] < 0xC0:
        return None
    for cut in range(len(out), max(len(out) - 4, 0), -1):
        try:
            return out[:cut].decode("utf-8") or None
        except UnicodeDecodeError:
            continue
    return None


# Bytes in the order a forced-byte search tries them: printable ASCII first, where a state
# that is not forced (a string body, a number) shows its second live byte within a few tries.
_SEARCH_ORDER = tuple(range(0x20, 0x7F)) + tuple(range(0x20)) + tuple(range(0x7F, 0x100))


def _forced_byte(m, state: tuple, pos: int, ctx):
    """(byte, next state) when exactly one byte continues `state`, else None. A `\\` beside
    another live byte is no choice (an escape only respells a character); the search stops
    at the second live byte that is not one, so a free state costs a few `advance` calls,
    not 256 (the answer is the same as stepping every byte)."""
    cand = m.candidates(state)
    order = _SEARCH_ORDER if cand is None else sorted(cand)
    found = escape = None
    for b in order:
        s = m.advance(state, b, pos, ctx)
        if not s:
            continue
        if b == 0x5C:
            escape = (b, s)
        elif found is not None:
            return None
        else:
            found = (b, s)
    return found if found is not None else escape


class CfgBackend(GrammarBackend):
    """JSON Schema and regex grammars on the lmprog grammar engine."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int],
                 config: GrammarBackendConfig = GrammarBackendConfig()):
        super().__init__(config)
        if not eos_token_ids:
            raise ValueError("eos_token_ids must name at least one token")
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.sample_tokenizer = SampleTokenizer(tokenizer)  # warmup.py's own copy, made on first use
        self.table = grammar_token_table(tokenizer, self.eos_token_ids)
        self.vocab = VocabInfo(self.table)
        self.registry = SchemaRegistry(config.schema_remotes)
        ws = config.whitespace_pattern
        self.whitespace = whitespace_regex(DEFAULT_MAX_WHITESPACE) if ws is None else ws

    def compile(self, kind: str, spec: str) -> CfgGrammar:
        machine = compile_machine(kind, spec, self.whitespace, self.config.compile_timeout_s, self.registry)
        shared = _Compiled(machine, MaskEngine(machine, self.vocab), self.table, self.eos_token_ids,
                           self.vocab_size)
        try:  # a matcher of its own walks the first masks into the shared caches (warmup.py)
            with shared.engine.warming():
                warm(CfgGrammar(shared), self.sample_tokenizer, spec if kind == "json" else None, self.registry)
        except Exception:  # noqa: BLE001 - only speed depends on it; the request will meet the error itself
            logger.debug("grammar warm-up failed", exc_info=True)
        shared.engine.reserve(TABLE_HEADROOM, TABLE_LEAST)
        return CfgGrammar(shared)


def compile_machine(kind: str, spec: str, whitespace: str = whitespace_regex(DEFAULT_MAX_WHITESPACE),
                    timeout_s: float = 60.0, registry: Optional[SchemaRegistry] = None) -> Machine:
    """The pushdown matcher of a `json` (schema text) or `regex` constraint; GrammarError
    naming what cannot be compiled. registry: where remote `$ref`s resolve (registry.py)."""
    pool = RegexPool(MAX_REGEX_TERMS)
    try:
        if kind == "regex":
            return Machine(None, pool, None, None, pool.EPS, regex_term=compile_pattern(pool, spec, False))
        if kind == "json":
            return _json_machine(spec, pool, whitespace, timeout_s, registry or SchemaRegistry())
        if kind == "ebnf":
            return EbnfMachine(spec)
    except GrammarError:
        raise
    except (UnsupportedSchemaError, RegexError, ValueError, RecursionError, TypeError, AttributeError,
            KeyError) as exc:
        raise GrammarError(f"Failed to compile {kind} grammar: {_reason(kind, spec, exc)}") from exc
    raise GrammarError(f"Failed to compile {kind} grammar: {kind} grammars are not supported by the "
                       "cfg backend (they are served by xgrammar)")


def _reason(kind: str, spec: str, exc: Exception) -> str:
    """What a failed compile tells: where a JSON Schema is not a valid schema of its dialect,
    its metaschema's first complaint and where (the compiler's own error on a malformed
    schema, `'int' object is not iterable`, says little); a schema that refers to itself in
    place, so; else the error."""
    if kind == "json" and not isinstance(exc, (UnsupportedSchemaError, RegexError)):
        try:
            schema = json.loads(spec)
            cls = validator_for(schema, default=Draft202012Validator)
            err = best_match(cls(cls.META_SCHEMA).iter_errors(schema))
        except Exception:  # noqa: BLE001 - not JSON, or no metaschema to hold it to: the error says it
            err = None
        if err is not None:
            where = "".join(f"/{p}" for p in err.absolute_path) or "/"
            return f"not a valid schema at {where!r}: {err.message}"
        if isinstance(exc, RecursionError):
            return ("the schema refers to itself where no value is read (a $ref / allOf / anyOf cycle in place: "
                    "a validator following it may never finish) or nests too deeply")
    return str(exc)


def _json_machine(spec: str, pool: RegexPool, whitespace: str, timeout_s: float,
                  registry: SchemaRegistry) -> Machine:
    schema = apply_vocabularies(inferred_dialect(True if spec.strip() == ANY_JSON else json.loads(spec)), registry)
    schema = older_keywords(ref_siblings(dependencies_compat(schema)))
    deadline = time.monotonic() + timeout_s
    options, drafts_error = {"unevaluated_structure": True, "ids_move_base": True}, None
    while True:
        compiler = None
        try:
            compiler = SchemaCompiler(schema, pool, deadline, registry, **options)
            root = compiler.compile()
            break
        except UnsupportedSchemaError as exc:
            if compiler is not None and compiler.unevaluated_tried and options["unevaluated_structure"]:
                # unevaluated* made structure brought a subschema into it that only their check
                # read (a pattern the structure cannot take): compiled again with them checks alone
                options["unevaluated_structure"] = False
            elif options["ids_move_base"] and id_dialect(schema) and (compiler is None or compiler.refs.legacy_ids):
                # a draft-04 `id` moved a base and a reference no longer resolves: the schema
                # uses its `id`s as labels, as real-world ones do (refs.py); read so
                options["ids_move_base"], drafts_error = False, exc
            else:
                raise drafts_error or exc  # (the drafts' reading's refusal, where the labels' failed too)
    lock = threading.Lock()
    others: dict = {}  # (node, undeclared key) -> its member rule: bounded (the keys are the outputs')

    def child_of(node, key: str):
        got = node._child.get(key, 0)  # (a declared property's: as many as the schema has)
        if got != 0:
            return got
        got = others.get((node, key), 0)
        if got != 0:
            return got
        with lock:
            got = _child(compiler, node, key)
            if key in node.props:
                node._child[key] = got
            else:
                if len(others) >= MAX_KEY_RULES:
                    others.clear()
                others[(node, key)] = got
        return got

    residual = compiler.checker()  # (the one that validated enum members at compile, where one did)
    return Machine(root, pool, residual, child_of, compile_pattern(pool, whitespace, False),
                   whole_integers=whole_integers(schema))


def accepts_text(machine: Machine, text: str) -> bool:
    """Byte-level acceptance of a whole output (tests, corpora)."""
    data = text.encode("utf-8")
    state = machine.initial()
    ctx = lambda start, end: data[start:end]  # noqa: E731
    for pos, b in enumerate(data):
        state = machine.advance(state, b, pos, ctx)
        if not state:
            return False
    return machine.accepting(state, len(data), ctx)


def _child(compiler: SchemaCompiler, node, key: str):
    """The rule of the value of member `key`: properties / patternProperties (all that apply)
    / additionalProperties; None when the key is not allowed (also where no value is: a
    member `k: false` is refused at its key's closing quote, not after the colon)."""
    hits = [node.props[key]] if key in node.props else []
    hits += [n for term, n in node.pattern_props if compiler.pool.accepts(term, key)]
    if not hits:
        return node.additional
    if len(hits) == 1:
        return None if hits[0].never else hits[0]
    # (one rule per set of rules that apply, not per key: every key matching the same
    # patterns shares its value's states and masks)
    both = ("__hits__",) + tuple(id(h) for h in hits)
    got = node._child.get(both)
    if got is None:
        compiler.deadline = None  # a member rule built while matching: the compile budget is spent
        got = node._child[both] = compiler.node(compiler._made({"allOf": [h.schema for h in hits]}))
    return None if got.never else got
