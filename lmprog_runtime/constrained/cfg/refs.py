"""`$ref` resolution for the schema compiler: base URIs, `$id`s, anchors, remote documents.

`RefIndex(root, registry)` indexes every schema object of the root document (and of each
remote document the moment a `$ref` first needs it) with its base URI: the enclosing
`$id`s joined as RFC 3986 says, starting from the root's `$id` ("" when it has none) or
from a remote document's retrieval URI. In a document whose `$schema` names draft-04 or
draft-03, `id` is that identifier, as those drafts say; elsewhere an `id` names its schema
(a `$ref` to it resolves) but does not move the base, and `ids_move_base=False` reads it
so in those drafts' documents too (real-world schemas use `id` as a plain label: the
compiler falls back to that reading where a reference does not resolve the drafts' way).
`resolve(ref, at)` joins `ref` against the base of the schema object `at` that holds it
and returns the target: a resource (`$id`), an anchor (`$anchor`, or a `$dynamicAnchor`
reached by a plain `$ref`) or a JSON pointer into one.
Remote documents come only from the local registry (registry.py), never the network.

`$dynamicRef` / `$recursiveRef` targets depend on the dynamic scope (the path of evaluation),
which a grammar rule cannot know; `dynamic` records that the schema has one, and the
compiler then checks the whole value against the whole schema (the residual validator
follows dynamic scopes exactly), with a superset structure for the reference itself.
"""
from __future__ import annotations

from typing import Optional

from lmprog_runtime.constrained.cfg.dialect import SCHEMA_KEYWORDS, id_dialect
from lmprog_runtime.constrained.cfg.registry import SchemaRegistry, join, split
from lmprog_runtime.constrained.regex_fragments import UnsupportedSchemaError
from lmprog_runtime.constrained.schema_merge import walk_pointer

MAX_INDEXED = 200_000  # schema objects indexed per compile
_DATA = frozenset(("enum", "const", "default", "examples", "example"))  # values, not schemas
_NAMED = frozenset(("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"))
# keywords whose values are schemas (or hold them: dialect.py's, and draft-03's `extends`,
# the content vocabulary's `contentSchema`): an `$id` or anchor anywhere else (inside an
# unknown keyword) is no identifier (JSON Schema 2020-12 §9.4.2); it is kept only as a fallback
# for a `$ref` no real one answers (real-world schemas park definitions in such keys)
_SCHEMA_KEYWORDS = SCHEMA_KEYWORDS | {"contentSchema", "extends"}


class RefIndex:
    def __init__(self, root, registry: Optional[SchemaRegistry] = None, ids_move_base: bool = True):
        self.root = root
        self.registry = registry or SchemaRegistry()
        self._ids_move_base = ids_move_base
        self.legacy_ids = False               # an `id` moved a base (a compile may then fall back)
        self.base: dict[int, str] = {}        # id(schema object) -> its base URI ($id applied)
        self.resources: dict[str, object] = {}  # URI (no fragment) or "URI#anchor" -> schema
        self._unknown: dict[str, object] = {}   # the same, of `$id`s and anchors inside unknown keywords
        self.docs: dict[str, object] = {}     # retrieval URI -> remote document loaded
        self.dynamic = False                  # a $dynamicRef / $recursiveRef was indexed
        self._seen = 0
        self._refs: list = []                 # (ref, holder) of the root document's `$ref`s
        self.root_base = self._index(root, "", self._refs)
        self.check_documents()

    def check_documents(self) -> None:
        """The document of every `$ref` of the root schema is known (remote ones loaded), so
        one the grammar never follows (inside `not`, `if`, ...: only the residual validator
        would) is refused at compile time rather than failing every check. Pointers and
        anchors, and the references inside remote documents, are checked where followed."""
        while self._refs:
            ref, at = self._refs.pop()
            uri = join(self.base_of(at), ref)
            self._resource(split(uri)[0], ref, uri)

    def base_of(self, s) -> str:
        """The base URI of schema object `s` (a schema made by merging: the root's)."""
        return self.base.get(id(s), self.root_base)

    def adopt(self, made, like) -> None:
        """A schema made from `like` (merges) resolves its `$ref`s from `like`'s base."""
        if id(like) in self.base:
            self.base.setdefault(id(made), self.base[id(like)])

    def resolve(self, ref: str, at):
        uri = join(self.base_of(at), ref)
        doc_uri, frag = split(uri)
        target = self._resource(doc_uri, ref, uri)
        if frag and not frag.startswith("/"):
            got = self.resources.get(doc_uri + "#" + frag) or self._unknown.get(doc_uri + "#" + frag)
            if got is None:
                raise UnsupportedSchemaError(f"$ref {ref!r}: unknown anchor {frag!r} in {doc_uri or 'the schema'}")
            return got
        return walk_pointer(target, frag, ref)  # frag: percent-decoded by split

    def _resource(self, doc_uri: str, ref: str, uri: str):
        if doc_uri == self.root_base:
            return self.root
        got = self.resources.get(doc_uri)
        if got is not None:
            return got
        doc = self.registry.get(doc_uri) if doc_uri else None
        if doc is None and doc_uri in self._unknown:
            return self._unknown[doc_uri]
        if doc is None:
            raise UnsupportedSchemaError(f"$ref {ref!r} (= {uri!r}): a remote reference that is neither in the "
                                         "schema nor in the local schema registry (schemas are never fetched)")
        self.docs[doc_uri] = doc
        self.resources.setdefault(doc_uri, doc)
        self._index(doc, doc_uri)
        return doc

    def _index(self, doc, base: str, refs: Optional[list] = None) -> str:
        """Index `doc` read at base URI `base`; returns the document's own base."""
        # (a remote document naming no dialect is 2020-12's, as the residual's registry reads it)
        legacy = self._ids_move_base and id_dialect(doc) is True
        top = self._with_id(doc, base, legacy)
        stack = [(doc, base, False, True)] if isinstance(doc, (dict, list)) else []
        while stack:
            # names: `s` maps names to schemas (properties, $defs, ...); known: reached through
            # schema keywords only
            s, here, names, known = stack.pop()
            self._seen += 1
            if self._seen > MAX_INDEXED:
                raise UnsupportedSchemaError(f"schema has more than {MAX_INDEXED} subschemas")
            if isinstance(s, list):
                stack.extend((v, here, False, known) for v in s if isinstance(v, (dict, list)))
                continue
            if names:
                stack.extend((v, here, False, known) for v in s.values() if isinstance(v, (dict, list)))
                continue
            named = self.resources if known else self._unknown
            if "$dynamicRef" in s or "$recursiveRef" in s:
                self.dynamic = True
            outer, here = here, self._with_id(s, here, legacy)
            if isinstance(s.get("$id"), str):
                named.setdefault(here if not s["$id"].startswith("#") else here + s["$id"], s)
            elif isinstance(s.get("id"), str):  # draft-04's `id`: names the schema (its base, where it moved it)
                named.setdefault(join(outer, s["id"]).rstrip("#"), s)
            self.base[id(s)] = here
            if refs is not None and isinstance(s.get("$ref"), str):
                refs.append((s["$ref"], s))
            for key in ("$anchor", "$dynamicAnchor"):
                if isinstance(s.get(key), str):
                    named.setdefault(here + "#" + s[key], s)
            stack.extend((v, here, k in _NAMED, known and k in _SCHEMA_KEYWORDS) for k, v in s.items()
                         if k not in _DATA and isinstance(v, (dict, list)))
        return top


    def _with_id(self, s, base: str, legacy: bool) -> str:
        """The base URI inside schema object `s` read at `base` (`legacy`: a draft-04 or
        draft-03 document, whose `id` sets it where no `$id` does)."""
        if not isinstance(s, dict):
            return base
        sid = s.get("$id")
        by_id = sid is None and legacy
        if by_id:
            sid = s.get("id")
        if not isinstance(sid, str) or sid.startswith("#"):
            return base
        here = join(base, sid).partition("#")[0]
        if by_id and here != base:
            self.legacy_ids = True
        return here
