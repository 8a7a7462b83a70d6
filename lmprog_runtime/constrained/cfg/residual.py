"""Semantic checks on a complete value's text: the keywords a grammar cannot state
(`not`, `if/then/else`, `oneOf`'s "exactly one", `dependentSchemas`, `contains`, enums of
numbers or objects, ...) are decided by a JSON Schema validator at the moment the value
they apply to is complete, against the subschema in the context of the document that holds
it (the root or a remote document of the local registry, so `$ref`s resolve from the `$id`s
around it; nothing is fetched: an unknown URI fails the check). A schema with dynamic
references is checked whole, from the root, so dynamic scopes are followed exactly.
A JSON Schema 2020-12 check runs as a compiled predicate where predicates.py compiles it (the
validator's answer, reached in a few µs instead of its generic descent's 15-180).
The formats the grammar asserts (patterns, formats.py) are asserted here too, inside the
checks that read a value whole (`not`, `anyOf`, ...): `formats.format_checks`.
"""
from __future__ import annotations

import json
import threading
from decimal import Decimal

from jsonschema import FormatChecker
from jsonschema.validators import Draft202012Validator, validator_for
from referencing import Registry
from referencing.jsonschema import DRAFT202012, specification_with

from lmprog_runtime.constrained.cfg.formats import format_checks
from lmprog_runtime.constrained.cfg.predicates import Compiler, Cycle
from lmprog_runtime.constrained.cfg.registry import SchemaRegistry
from lmprog_runtime.constrained.schema_merge import equality_form


MEMO_TEXTS = 2048      # memoized value checks per grammar (at most 2048 x 256 bytes of text)
MEMO_TEXT_BYTES = 256


class Residual:
    def __init__(self, root, registry=None, docs=None):
        """registry: the SchemaRegistry remote `$ref`s resolve in; docs: retrieval URI ->
        remote document whose subschemas may be checked (the compiler's, filled as it loads)."""
        cls = validator_for(root, default=Draft202012Validator) if isinstance(root, dict) else Draft202012Validator
        formats = format_checks(root, registry if registry is not None else SchemaRegistry())
        checker = FormatChecker(formats=())
        for name, test in formats.items():
            checker.checks(name)(test)
        # an explicit registry: jsonschema's default one would fetch unknown URIs over the network
        validator = cls(root, registry=registry.referencing() if registry is not None else Registry(),
                        format_checker=checker)
        self._validator = validator.evolve(_resolver=_crawled(validator._resolver))
        self._spec = specification_with(cls.META_SCHEMA.get("$schema", ""), default=DRAFT202012)
        self._root = root
        self._scopes = {k: (None, v) for k, v in _lexical_scopes(root).items()}
        self._docs = docs if docs is not None else {}
        self._scanned: set = set()
        self._lock = threading.Lock()  # the referencing resolver is not documented as thread-safe
        self._memo: dict = {}  # (id(schema), text) -> valid_text (schemas live as long as the root)
        self._validators: dict = {}  # id(schema) -> (its validator, from its scope's resolver; its compiled check)
        self._compiler = Compiler(self._spec, formats)  # (the checks' rules, shared: a subschema's is compiled once)

    def valid(self, value, schema) -> bool:
        """`value` satisfies `schema` (a subschema of the root, whose `$ref`s resolve from
        the `$id`s around it). A check that cannot be carried out counts as a failure."""
        try:
            with self._lock:
                got = self._validators.get(id(schema))
                if got is None:
                    got = self._validators[id(schema)] = self._validator_of(schema)
            validator, compiled = got
            if compiled is not None:
                try:
                    return compiled(value)
                except Cycle:  # (the validator would recurse until RecursionError: unchecked)
                    return False
                except Exception:  # noqa: BLE001 - (an overflow, a recursion limit): the validator decides
                    pass
            with self._lock:
                return validator.is_valid(value)
        except Exception:  # noqa: BLE001 - an unresolvable reference: never accept what is unchecked
            return False

    def _validator_of(self, schema) -> tuple:
        """(the validator of `schema`, from its scope's resolver, as `descend` makes it; its
        compiled predicate, predicates.py, or None)."""
        if schema is self._root:
            validator = self._validator
        else:
            doc, chain = self._scope(schema)
            resolver = self._validator._resolver
            if doc is not None:
                resolver = _crawled(resolver.lookup(doc).resolver)
            for scope in chain + (schema,):
                if isinstance(scope, dict):
                    resolver = resolver.in_subresource(self._spec.create_resource(scope))
            validator = self._validator.evolve(schema=schema, _resolver=resolver)
        compiled = None
        if type(validator) is Draft202012Validator:  # (predicates.py compiles that dialect only)
            compiled = self._compiler.check(schema, validator._resolver)
        return validator, compiled

    def _scope(self, schema) -> tuple:
        """(retrieval URI of the remote document holding `schema`, or None for the root;
        the schemas with an `$id` around it inside that document, outermost first)."""
        got = self._scopes.get(id(schema))
        if got is None:
            for uri, doc in list(self._docs.items()):
                if uri not in self._scanned:
                    self._scanned.add(uri)
                    self._scopes.update({k: (uri, v) for k, v in _lexical_scopes(doc).items()})
            got = self._scopes.get(id(schema), (None, ()))
        return got

    def valid_text(self, text: bytes, schema) -> bool:
        """`valid` on a value's JSON text; short texts memoized (a mask's walk checks one
        value once per byte that may follow it)."""
        key = (id(schema), text) if len(text) <= MEMO_TEXT_BYTES else None
        got = self._memo.get(key) if key is not None else None
        if got is not None:
            return got
        try:
            value = json.loads(text.decode("utf-8"))
        except (ValueError, UnicodeDecodeError):
            return False
        got = self.valid(value, schema)
        if key is not None:
            with self._lock:
                if len(self._memo) >= MEMO_TEXTS:
                    self._memo.clear()
                self._memo[key] = got
        return got


def _crawled(resolver):
    """The resolver with its registry crawled (every `$id` and anchor of its documents
    indexed): a registry is immutable, and a lookup in one not crawled crawls it again on
    each check (`referencing` hands the crawled copy only to that lookup's descent)."""
    return resolver._registry.crawl().resolver(base_uri=resolver._base_uri)


def _lexical_scopes(root) -> dict:
    """id(subschema) -> the enclosing subschemas that carry an `$id`, outermost first."""
    out: dict = {}
    stack = [(root, ())]
    while stack and len(out) < 200_000:
        node, chain = stack.pop()
        if isinstance(node, dict):
            out[id(node)] = chain
            inner = chain + (node,) if node is not root and isinstance(node.get("$id"), str) else chain
            stack.extend((v, inner) for v in node.values() if isinstance(v, (dict, list)))
        elif isinstance(node, list):
            stack.extend((v, chain) for v in node if isinstance(v, (dict, list)))
    return out


def canonical(text: bytes):
    """A hashable value of JSON text under JSON Schema equality (1 == 1.0, true != 1)."""
    return equality_form(json.loads(text.decode("utf-8"), parse_float=Decimal, parse_int=Decimal))
