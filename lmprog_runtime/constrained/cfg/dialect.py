"""Vocabularies of a custom metaschema: keywords of a vocabulary it does not list are not
assertions (JSON Schema 2020-12 §8.1.2), so they are removed before compiling. Draft-07's
`dependencies` read in the dialects that split it (`dependencies_compat`); a `$ref`'s sibling
keywords dropped where the dialect ignores them (`ref_siblings`). And the dialects whose
`integer` is written without a fraction (`whole_integers`), and those whose `id` sets a base
URI (`id_dialect`: draft-04 and draft-03; `$id` from draft-06 on). A schema without `$schema` that
writes `items` as an array is read as draft-07 (`inferred_dialect`). A keyword a later draft
introduced asserts nothing in a schema that declares an older one (`older_keywords`: `const`
in draft-04, `if` in draft-06, `prefixItems` in draft-07 ...), as its validator ignores it.

A schema whose `$schema` names a metaschema of the local registry that carries
`$vocabulary` (e.g. one listing core and applicator but not validation) is rewritten with
the keywords of the validation, applicator and unevaluated vocabularies (2020-12 or
2019-09 URIs) it lacks removed from every subschema; both the grammar and the residual validator then read the
rewritten schema. Any other schema is returned as is.
"""
from __future__ import annotations

from typing import Optional

from jsonschema.validators import (Draft3Validator, Draft4Validator, Draft6Validator, Draft7Validator,
                                   Draft201909Validator, Draft202012Validator, validator_for)

_V20 = "https://json-schema.org/draft/2020-12/vocab/"
_V19 = "https://json-schema.org/draft/2019-09/vocab/"
# keywords of a vocabulary -> the vocabulary URIs (2020-12, 2019-09) that provide them
VOCABULARIES = (
    (frozenset(("type", "const", "enum", "multipleOf", "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum",
                "maxLength", "minLength", "pattern", "maxItems", "minItems", "uniqueItems", "maxContains",
                "minContains", "maxProperties", "minProperties", "required", "dependentRequired")),
     (_V20 + "validation", _V19 + "validation")),
    (frozenset(("prefixItems", "items", "additionalItems", "contains", "additionalProperties", "properties",
                "patternProperties", "dependentSchemas", "propertyNames", "if", "then", "else", "allOf", "anyOf",
                "oneOf", "not")),
     (_V20 + "applicator", _V19 + "applicator")),
    (frozenset(("unevaluatedItems", "unevaluatedProperties")), (_V20 + "unevaluated", _V19 + "applicator")),
)
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")
_SCHEMA_ONE = ("additionalProperties", "propertyNames", "items", "contains", "not", "if", "then", "else",
               "unevaluatedItems", "unevaluatedProperties", "additionalItems")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
SCHEMA_KEYWORDS = frozenset(_SCHEMA_MAPS + _SCHEMA_ONE + _SCHEMA_LISTS)  # (those whose values are or hold schemas)


def apply_vocabularies(root, registry):
    """`root` without the keywords of the vocabularies its metaschema leaves out."""
    dialect = root.get("$schema") if isinstance(root, dict) else None
    meta = registry.get(dialect.rstrip("#")) if isinstance(dialect, str) else None
    vocab = meta.get("$vocabulary") if isinstance(meta, dict) else None
    if not isinstance(vocab, dict):
        return root
    dropped = frozenset().union(*(kws for kws, uris in VOCABULARIES if not any(u in vocab for u in uris)))
    return _strip(root, dropped, 0) if dropped else root


def _strip(s, dropped: frozenset, depth: int):
    return _rewrite(s, lambda d: {k: v for k, v in d.items() if k not in dropped}, None, depth)


def _rewrite(s, before, after, depth: int):
    """A copy of schema `s` with `before` applied to each subschema object on the way down
    (its result's subschemas are the ones descended into) and `after` (where given) to each
    rebuilt one on the way up."""
    if not isinstance(s, dict) or depth > 512:
        return s
    out = {}
    for k, v in before(s).items():
        if k in _SCHEMA_MAPS and isinstance(v, dict):
            v = {name: _rewrite(x, before, after, depth + 1) for name, x in v.items()}
        elif k in _SCHEMA_LISTS and isinstance(v, list):
            v = [_rewrite(x, before, after, depth + 1) for x in v]
        elif k in _SCHEMA_ONE:
            v = _rewrite(v, before, after, depth + 1)
        out[k] = v
    return after(out) if after is not None else out


# draft-04 and draft-03: their `integer` is "a JSON number without a fraction or exponent
# part" (`1.0` is not one there; from draft-06 on any number with a zero fractional part is:
# the residual's validator, of the same dialect, agrees), and their identifier keyword is `id`
_OLD_DIALECTS = frozenset(f"{scheme}://json-schema.org/draft-{n}/schema"
                          for scheme in ("http", "https") for n in ("03", "04"))


def id_dialect(doc) -> Optional[bool]:
    """Whether document `doc`'s `$schema` names draft-04 or draft-03 (whose identifier keyword
    is `id`: it sets the base URI of the schema that holds it), False where it names another
    dialect, None where it names none."""
    dialect = doc.get("$schema") if isinstance(doc, dict) else None
    if not isinstance(dialect, str):
        return None
    return dialect.rstrip("#") in _OLD_DIALECTS


def whole_integers(root) -> bool:
    """Whether `root`'s `$schema` names a dialect in which an integer has no fraction part."""
    return id_dialect(root) is True


def dependencies_compat(root):
    """`root` with draft-07's `dependencies` also written as what 2019-09 split it into, where
    its dialect's validator does not know it (2019-09, 2020-12, no `$schema`): a list of names
    as `dependentRequired`, a schema as `dependentSchemas` (JSON-Schema-Test-Suite's optional
    dependencies-compatibility: schemas written for draft-07 mean them). The keyword stays,
    so JSON pointers into it still resolve. Any other schema is returned as is."""
    if not isinstance(root, dict):
        return root
    if "dependencies" in validator_for(root, default=Draft202012Validator).VALIDATORS:
        return root  # (draft-07 and older: the keyword itself)
    return _rewrite(root, lambda d: d, _split_dependencies, 0)


def _split_dependencies(out: dict) -> dict:
    deps = out.get("dependencies")
    required, schemas = out.get("dependentRequired", {}), out.get("dependentSchemas", {})
    if not isinstance(deps, dict) or not isinstance(required, dict) or not isinstance(schemas, dict):
        return out
    required, schemas = dict(required), dict(schemas)
    for name, dep in deps.items():
        if isinstance(dep, list):
            required[name] = list(dict.fromkeys(list(required.get(name, ())) + dep))
        else:
            schemas[name] = dep if name not in schemas else {"allOf": [schemas[name], dep]}
    if required:
        out["dependentRequired"] = required
    if schemas:
        out["dependentSchemas"] = schemas
    return out


def ref_siblings(root):
    """`root` with every `$ref`'s sibling keywords removed where its dialect ignores them
    (draft-07 and older: "all other properties in a `$ref` object MUST be ignored"), its
    `$id` / `id` too (it does not move the base there); what is no keyword of the dialect
    stays (`definitions`: JSON pointers into it still resolve). 2019-09 on, the siblings
    apply beside the reference (the compiler joins them, schema.py `deref`)."""
    if not isinstance(root, dict):
        return root
    cls = validator_for(root, default=Draft202012Validator)
    if cls not in (Draft3Validator, Draft4Validator, Draft6Validator, Draft7Validator):
        return root
    ignored = frozenset(cls.VALIDATORS) - {"$ref"} | {"$id", "id"}
    return _rewrite(root, lambda d: {k: v for k, v in d.items() if k not in ignored}
                    if isinstance(d.get("$ref"), str) else d, None, 0)


DRAFT_07 = "http://json-schema.org/draft-07/schema#"


def inferred_dialect(root):
    """`root` with `$schema` draft-07 where it names none and writes `items` as an array of
    schemas somewhere (draft-07's tuple form, which 2020-12, the default, has no meaning for:
    such a schema is written for an older draft); otherwise `root` itself."""
    if not isinstance(root, dict) or "$schema" in root or not _array_items(root, 0):
        return root
    return dict(root, **{"$schema": DRAFT_07})


def _array_items(s, depth: int) -> bool:
    if not isinstance(s, dict) or depth > 512:
        return False
    if isinstance(s.get("items"), list):
        return True
    for k, v in s.items():
        if k in _SCHEMA_MAPS and isinstance(v, dict):
            if any(_array_items(x, depth + 1) for x in v.values()):
                return True
        elif k in _SCHEMA_LISTS and isinstance(v, list):
            if any(_array_items(x, depth + 1) for x in v):
                return True
        elif k in _SCHEMA_ONE and _array_items(v, depth + 1):
            return True
    return False


# the keywords each older dialect lacks (later drafts introduced them); `$anchor` and the like
# stay: they only name schemas, and a reference the dialect cannot resolve fails either way
_AFTER_07 = frozenset(("dependentRequired", "dependentSchemas", "prefixItems", "unevaluatedItems",
                       "unevaluatedProperties", "minContains", "maxContains", "$dynamicRef", "$recursiveRef"))
_LACKS = {Draft3Validator: _AFTER_07 | {"const", "contains", "propertyNames", "if", "then", "else", "not", "allOf", "anyOf",
                                         "oneOf", "multipleOf", "minProperties", "maxProperties"},
          Draft4Validator: _AFTER_07 | {"const", "contains", "propertyNames", "if", "then", "else"},
          Draft6Validator: _AFTER_07 | {"if", "then", "else"},
          Draft7Validator: _AFTER_07,
          Draft201909Validator: frozenset(("prefixItems", "$dynamicRef"))}


def older_keywords(root):
    """`root` without the keywords its declared dialect does not have (`_LACKS`) in any
    subschema: an unknown keyword is an annotation there, and the dialect's validator (the
    residual's) ignores it too. Any other schema is returned as is."""
    if not isinstance(root, dict):
        return root
    cls = validator_for(root, default=Draft202012Validator)
    lacks = _LACKS.get(cls)
    if cls is Draft3Validator:
        return _rewrite(root, lambda d: _draft3_required({k: v for k, v in d.items() if k not in lacks}), None, 0)
    return _strip(root, lacks, 0) if lacks else root


def _draft3_required(d: dict) -> dict:
    """Draft-03's `required: true` in a property's schema also as its parent's `required`
    list (the later drafts' form, which the structure reads; the boolean stays for the
    residual's Draft3Validator, which reads only it, and the structure ignores it)."""
    props = d.get("properties")
    if isinstance(props, dict) and not isinstance(d.get("required"), list):
        names = [k for k, v in props.items() if isinstance(v, dict) and v.get("required") is True]
        if names:
            return {**d, "required": names}
    return d
