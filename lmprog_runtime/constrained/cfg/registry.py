"""Local schema registry: absolute URI -> schema document, never the network.

A `$ref` to an absolute URI (or one relative to an `$id`) that is not inside the schema
itself resolves here: the JSON Schema metaschemas (the `jsonschema-specifications` package,
bundled with `jsonschema`) plus folders of schema files named by
`GrammarBackendConfig.schema_remotes` ((base URI, folder) pairs: `<folder>/a/b.json` is
`<base URI>a/b.json`). A URI found nowhere is refused at compile time.

URIs are joined as RFC 3986 says, with one addition `urljoin` lacks: a fragment-only
reference against a non-hierarchical base (`urn:...`) keeps the base.
"""
from __future__ import annotations

import json
import pathlib
import re
from functools import lru_cache
from typing import Iterable, Optional
from urllib.parse import unquote, urljoin

_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*:")


def join(base: str, ref: str) -> str:
    """`ref` resolved against the base URI `base` ("" = no base: `ref` stays relative)."""
    if _SCHEME.match(ref):
        return ref
    if ref.startswith("#") or not ref:
        return base.partition("#")[0] + ref
    if not base:
        return ref
    return urljoin(base, ref)


def split(uri: str) -> tuple[str, str]:
    """(URI without fragment, fragment)."""
    doc, _, frag = uri.partition("#")
    return doc, unquote(frag)


@lru_cache(maxsize=1)
def _metaschemas() -> dict:
    from jsonschema_specifications import REGISTRY

    return {uri.rstrip("#"): REGISTRY.contents(uri) for uri in REGISTRY}


@lru_cache(maxsize=16)
def _folder(base: str, folder: str) -> dict:
    root = pathlib.Path(folder)
    out = {}
    for p in sorted(root.rglob("*.json")):
        out[base + p.relative_to(root).as_posix()] = json.loads(p.read_text())
    return out


class SchemaRegistry:
    """URI (no fragment) -> document, from the metaschemas and the configured folders."""

    def __init__(self, remotes: Iterable[tuple[str, str]] = ()):
        self._docs: dict = {}
        for base, folder in remotes:
            self._docs.update(_folder(base, str(folder)))

    def get(self, uri: str) -> Optional[object]:
        uri = uri.rstrip("#")
        got = self._docs.get(uri)
        if got is None:
            got = _metaschemas().get(uri)
        return got

    def referencing(self):
        """The same documents as a `referencing.Registry` (no retrieval: unknown URIs fail)."""
        from referencing import Registry, Resource
        from referencing.jsonschema import DRAFT202012

        return Registry().with_resources(
            (uri, Resource.from_contents(doc, default_specification=DRAFT202012)) for uri, doc in self._docs.items())
