"""cfg references and dialect rules at token level: remote `$ref`s from the local schema
registry (folders and the bundled metaschemas, never the network) with RFC 3986 base URIs,
`$dynamicRef` checked whole, `format` as the dialect says, `1.0` as an integer."""
import json

import pytest

from lmprog_runtime.constrained import GrammarError, create_grammar_backend
from lmprog_runtime.constrained.base import GrammarBackendConfig
from lmprog_runtime.constrained.cfg.registry import join
from test_cfg_engine import check, compile_

BASE = "http://schemas.test/"
REMOTES = {
    "integer.json": {"type": "integer"},
    "defs.json": {"$defs": {"pos": {"type": "integer", "minimum": 1}, "ref_pos": {"$ref": "#/$defs/pos"}},
                  "$anchor": "top", "type": "object"},
    "folder/named.json": {"$id": "http://other.test/named.json", "$defs": {"s": {"$ref": "leaf.json"}},
                          "$anchor": "named", "type": "string", "maxLength": 3},
    "meta-applicator-only.json": {
        "$schema": "https://json-schema.org/draft/2020-12/schema", "$id": BASE + "meta-applicator-only.json",
        "$vocabulary": {"https://json-schema.org/draft/2020-12/vocab/core": True,
                        "https://json-schema.org/draft/2020-12/vocab/applicator": True},
        "$dynamicAnchor": "meta", "allOf": [{"$ref": "https://json-schema.org/draft/2020-12/meta/core"},
                                            {"$ref": "https://json-schema.org/draft/2020-12/meta/applicator"}]},
    "tree.json": {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": BASE + "tree.json",
                  "$dynamicAnchor": "node", "type": "object",
                  "properties": {"data": True, "children": {"type": "array", "items": {"$dynamicRef": "#node"}}}},
}


@pytest.fixture(scope="module")
def cfg_remote(tokenizer, tmp_path_factory):
    folder = tmp_path_factory.mktemp("remotes")
    for name, doc in REMOTES.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(json.dumps(doc))
    be = create_grammar_backend("cfg", tokenizer, vocab_size=49152 + 64, eos_token_ids=[tokenizer.eos_token_id],
                                config=GrammarBackendConfig(schema_remotes=((BASE, str(folder)),)))
    yield be
    be.shutdown()


def test_uri_join():
    assert join("", "a.json") == "a.json"
    assert join("http://x.test/a/b.json", "c.json#/$defs/d") == "http://x.test/a/c.json#/$defs/d"
    assert join("http://x.test/a/b.json", "/abs.json") == "http://x.test/abs.json"
    assert join("urn:uuid:1234", "#/$defs/x") == "urn:uuid:1234#/$defs/x"
    assert join("http://x.test/a.json", "urn:x:y") == "urn:x:y"


def test_remote_documents_pointers_and_anchors(cfg_remote, tokenizer):
    check(cfg_remote, tokenizer, {"$ref": BASE + "integer.json"}, [1, -3], ["1", 1.5])
    check(cfg_remote, tokenizer, {"$ref": BASE + "defs.json#/$defs/ref_pos"}, [1, 7], [0, "a"])
    check(cfg_remote, tokenizer, {"$ref": BASE + "defs.json#top"}, [{}], [[]])
    # relative to the root's $id; inside the remote, relative to *its* $id (other.test)
    check(cfg_remote, tokenizer, {"$id": BASE + "root.json", "properties": {"n": {"$ref": "folder/named.json"}}},
          [{"n": "abc"}], [{"n": "abcd"}, {"n": 1}])
    # a member named like a data keyword is still a schema, resolved from its resource's base
    inner = {"$id": BASE + "folder/inner.json", "properties": {"default": {"$ref": "named.json"}}}
    check(cfg_remote, tokenizer, {"properties": {"x": inner}}, [{"x": {"default": "ab"}}], [{"x": {"default": 1}}])


def test_unknown_remote_is_refused_not_fetched(cfg_remote):
    with pytest.raises(GrammarError, match="never fetched"):
        compile_(cfg_remote, {"$ref": "http://example.com/not-there.json"})
    with pytest.raises(GrammarError, match="local schema registry"):  # its ref leaves the registry
        compile_(cfg_remote, {"$ref": BASE + "folder/named.json#/$defs/s"})
    with pytest.raises(GrammarError, match="never fetched"):  # only the residual validator would follow it
        compile_(cfg_remote, {"type": "integer", "not": {"$ref": "http://example.com/x.json"}})


def test_metaschema_refs_resolve_locally(cfg_remote, tokenizer):
    meta = {"$ref": "https://json-schema.org/draft/2020-12/schema"}
    check(cfg_remote, tokenizer, meta, [{"type": "string", "minLength": 2}, True],
          [{"type": 1}, {"minLength": -1}, {"properties": {"a": 3}}])


def test_dynamic_ref_follows_the_dynamic_scope(cfg_remote, tokenizer):
    tree = {"$ref": BASE + "tree.json"}
    check(cfg_remote, tokenizer, tree, [{"children": [{"data": 1, "children": []}]}], [{"children": [1]}])
    strict = {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": BASE + "strict-tree.json",
              "$dynamicAnchor": "node", "$ref": "tree.json", "unevaluatedProperties": False}
    check(cfg_remote, tokenizer, strict, [{"children": [{"data": 1}]}],
          [{"children": [{"daat": 1}]}, {"x": 1}])


def test_format_follows_the_dialect(cfg_remote, tokenizer):
    date = {"type": "string", "format": "date"}
    check(cfg_remote, tokenizer, date, ["2024-02-29"], ["x"])  # no $schema: asserted
    check(cfg_remote, tokenizer, {"$schema": "http://json-schema.org/draft-07/schema#", **date}, ["2024-02-29"], ["x"])
    check(cfg_remote, tokenizer, {"$schema": "https://json-schema.org/draft/2020-12/schema", **date},
          ["2024-02-29", "x"], [1])  # 2020-12: an annotation


def test_integer_with_a_zero_fraction(cfg_remote, tokenizer):
    check(cfg_remote, tokenizer, {"type": "integer", "maximum": 3}, [1, 3], [1.5, 4, "1"])
    for text, ok in (("1.0", True), ("-2.00", True), ("3.0", True), ("4.0", False), ("1.05", False)):
        g = compile_(cfg_remote, {"type": "integer", "maximum": 3})
        assert _walk(g, tokenizer, text) is ok, text


def _walk(g, tokenizer, text) -> bool:
    import torch

    row = torch.zeros(49152 + 64, dtype=torch.bool)
    for t in tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]:
        row.numpy().fill(False)
        g.fill_mask(row)
        if not row[t]:
            return False
        g.accept_token(t)
    return True


def test_vocabularies_a_metaschema_leaves_out_do_not_assert(cfg_remote, tokenizer):
    schema = {"$schema": BASE + "meta-applicator-only.json",
              "properties": {"n": {"minimum": 10, "type": "string"}, "no": False}}
    check(cfg_remote, tokenizer, schema, [{"n": 1}, {"n": 20}, 5], [{"no": 1}])  # applicator still applies
    check(cfg_remote, tokenizer, {"properties": {"n": {"minimum": 10}}}, [{"n": 10}], [{"n": 1}])
    for dialect in ("https://json-schema.org/draft/2020-12/schema", "https://json-schema.org/draft/2019-09/schema"):
        check(cfg_remote, tokenizer, {"$schema": dialect, "properties": {"n": {"minimum": 10}}, "required": ["n"]},
              [{"n": 10}], [{"n": 1}, {}])


def test_ref_siblings_follow_the_dialect(cfg_remote, tokenizer):
    """Draft-07 and older ignore every keyword beside a `$ref` (its `$id` too: the base does
    not move); 2019-09 on they apply beside the reference. Pointers into a sibling that is
    no keyword (`definitions`) still resolve."""
    d7 = "http://json-schema.org/draft-07/schema#"
    body = {"definitions": {"reffed": {"type": "array"}},
            "properties": {"foo": {"$ref": "#/definitions/reffed", "maxItems": 2}}}
    check(cfg_remote, tokenizer, dict(body, **{"$schema": d7}), [{"foo": [1, 2, 3]}, {"foo": []}], [{"foo": "x"}])
    check(cfg_remote, tokenizer, body, [{"foo": [1, 2]}], [{"foo": [1, 2, 3]}, {"foo": "x"}])
    moved = {"$schema": d7, "$id": BASE + "sibling/base/",
             "definitions": {"foo": {"$id": "foo.json", "type": "integer"}},
             "allOf": [{"$id": BASE + "sibling/", "$ref": "foo.json"}]}
    check(cfg_remote, tokenizer, moved, [1], ["a"])
    root_ref = {"$schema": d7, "$ref": "#/definitions/s", "type": "integer", "definitions": {"s": {"type": "string"}}}
    check(cfg_remote, tokenizer, root_ref, ["abc"], [1])


def test_array_items_without_schema_are_read_as_draft_07(cfg_remote, tokenizer):
    """`items` as an array of schemas has no meaning in 2020-12 (the default dialect): a
    schema without `$schema` that writes it is a draft-07 one (tuple items, additionalItems)."""
    tuple_ = {"type": "array", "items": [{"type": "integer"}, {"type": "string"}], "additionalItems": False}
    check(cfg_remote, tokenizer, tuple_, [[1, "a"], [1], []], [["a"], [1, "a", 2], [1, 2]])
    nested = {"properties": {"p": {"items": [{"const": 1}], "additionalItems": {"type": "string"}}}}
    check(cfg_remote, tokenizer, nested, [{"p": [1, "x"]}], [{"p": [2]}, {"p": [1, 2]}])


def test_a_reference_back_to_an_enclosing_schema_with_siblings(cfg_remote, tokenizer):
    """`{"$ref": "#", ...}` inside the root: the conjunction's structure is the root's, read
    as it will be once compiled (not a copy of it half made: its keys' rule was unset, and
    the first mask inside such an object raised), the whole conjunction checked at its end."""
    schema = {"properties": {"foo": {"$ref": "#", "additionalProperties": False}}, "additionalProperties": False}
    check(cfg_remote, tokenizer, schema, [{"foo": {}}, {"foo": False}, {}, {"foo": 1}],
          [{"foo": {"foo": {}}}, {"foo": {"bar": 1}}, {"bar": 1}])


def test_a_reference_back_with_siblings_that_merge(cfg_remote, tokenizer):
    """`{"$ref": "#", "type": "integer"}` under a property: the root merged with the sibling
    holds the property again, whose reference is the same node, not a new merge (each merge
    made the next: the compile recursed without end). Values nest: the root on an integer
    asks nothing of it."""
    schema = {"properties": {"foo": {"$ref": "#", "type": "integer"}}, "additionalProperties": False}
    check(cfg_remote, tokenizer, schema, [{"foo": 1}, {}], [{"foo": "x"}, {"foo": {"foo": 1}}, {"bar": 1}])
    tree = {"type": "object", "properties": {"value": {"type": "integer"},
                                             "kids": {"type": "array", "items": {"$ref": "#", "required": ["value"]}}}}
    check(cfg_remote, tokenizer, tree, [{"value": 1, "kids": [{"value": 2, "kids": [{"value": 3}]}]}],
          [{"kids": [{"kids": []}]}, {"kids": [{"value": "x"}]}])


def test_a_schema_that_is_one_of_its_own_alternatives(cfg_remote, tokenizer):
    """`{"anyOf": [..., {"$ref": "#", ...}]}`: the root is an alternative of itself; a value's
    start expands it once (met again it adds only its own values under more checks: its
    start recursed without end). Only the other branches can be met: an instance that fails
    them meets the reference again and again (the validator's recursion has no end)."""
    schema = {"properties": {"foo": {"type": "string"}}, "anyOf": [
        {"properties": {"bar": {"const": "bar"}}, "required": ["bar"]},
        {"properties": {"baz": {"const": "baz"}}, "required": ["baz"]},
        {"properties": {"quux": {"const": "quux"}}, "required": ["quux"], "$ref": "#"}],
        "unevaluatedProperties": False}
    check(cfg_remote, tokenizer, schema, [{"foo": "foo", "bar": "bar"}, {"baz": "baz"}],
          [{"quux": "quux"}, {"bar": "x"}, {"foo": 1, "bar": "bar"}, {}, {"bar": "bar", "x": 1}])


def test_keywords_and_formats_of_later_drafts_are_annotations_in_older_ones(cfg_remote, tokenizer):
    """A keyword or format a later draft introduced asserts nothing where the schema declares
    an older dialect, as that dialect's validator ignores it: `const` / `propertyNames` in
    draft-04, `if` in draft-06, `prefixItems` in draft-07, `format: date` in draft-04,
    `format: uuid` in draft-07; they do assert in the draft that has them."""
    d4, d6, d7 = (f"http://json-schema.org/draft-0{n}/schema#" for n in (4, 6, 7))
    check(cfg_remote, tokenizer, {"$schema": d4, "properties": {"a": {"type": "string", "const": "x"}}},
          [{"a": "y"}, {"a": "x"}], [{"a": 1}])
    check(cfg_remote, tokenizer, {"$schema": d6, "properties": {"a": {"type": "string", "const": "x"}}},
          [{"a": "x"}], [{"a": "y"}])
    check(cfg_remote, tokenizer, {"$schema": d4, "propertyNames": {"maxLength": 1}}, [{"ab": 1}], [])
    check(cfg_remote, tokenizer, {"$schema": d6, "if": {"type": "string"}, "then": {"maxLength": 1}}, ["abc"], [])
    check(cfg_remote, tokenizer, {"$schema": d7, "if": {"type": "string"}, "then": {"maxLength": 1}}, ["a"], ["abc"])
    check(cfg_remote, tokenizer, {"$schema": d7, "prefixItems": [{"type": "string"}]}, [[1]], [])
    check(cfg_remote, tokenizer, {"$schema": d4, "type": "string", "format": "date"}, ["x"], [])
    check(cfg_remote, tokenizer, {"$schema": d7, "type": "string", "format": "date"}, ["2024-01-02"], ["x"])
    check(cfg_remote, tokenizer, {"$schema": d7, "type": "string", "format": "uuid"}, ["x"], [])
    check(cfg_remote, tokenizer, {"type": "string", "format": "uuid"}, ["123e4567-e89b-12d3-a456-426614174000"], ["x"])
    # draft-04's exclusiveMaximum is a flag on maximum: a number there bounds nothing (a non-zero
    # one sets the flag, as Draft4Validator reads it)
    check(cfg_remote, tokenizer, {"$schema": d4, "type": "integer", "exclusiveMaximum": 3}, [12345, 3], [])
    check(cfg_remote, tokenizer, {"$schema": d4, "type": "integer", "minimum": -9, "exclusiveMinimum": -1}, [-8], [-9])
    check(cfg_remote, tokenizer, {"$schema": d4, "type": "integer", "maximum": 3, "exclusiveMaximum": True}, [2], [3])
    check(cfg_remote, tokenizer, {"$schema": d6, "type": "integer", "exclusiveMaximum": 3}, [2], [3, 12345])


def test_dynamic_reference_beside_unevaluated_keywords_under_a_sibling(cfg_remote, tokenizer):
    """A `$dynamicRef` evaluates members for the unevaluatedProperties beside it: the structure
    drops both (a superset; the whole value is checked), also where the root's `$ref` has a
    sibling keyword (the conjunction's path read unevaluatedProperties alone: `bar` refused)."""
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": "https://example.com/derived",
              "$ref": "./base", "minItems": 1,
              "$defs": {"derived": {"$dynamicAnchor": "addons", "properties": {"bar": {"type": "string"}}},
                        "base": {"$id": "./base", "unevaluatedProperties": False,
                                 "properties": {"foo": {"type": "string"}}, "$dynamicRef": "#addons",
                                 "$defs": {"defaultAddons": {"$dynamicAnchor": "addons"}}}}}
    check(cfg_remote, tokenizer, schema, [{"foo": "foo", "bar": "bar"}, {"foo": "foo"}], [{"foo": "foo", "baz": 1}])


D4 = "http://json-schema.org/draft-04/schema#"


def test_draft_04_ids_set_base_uris(cfg_remote, tokenizer):
    # in a draft-04 document `id` is the identifier: it sets the base its `$ref`s resolve
    # against, here to another schema than the root's base gives (jsonschema's Draft4Validator
    # reads it so); a remote document reached through such a base too
    from jsonschema import Draft4Validator

    schema = {"$schema": D4, "id": "http://example.test/root.json",
              "definitions": {"item": {"id": "item.json", "type": "integer"},
                              "folder": {"id": "folder/", "properties": {"b": {"$ref": "item.json"}}},
                              "folder_item": {"id": "folder/item.json", "type": "string"}},
              "properties": {"a": {"$ref": "item.json"}, "f": {"$ref": "#/definitions/folder"}}}
    valid, invalid = [{"a": 1, "f": {"b": "x"}}], [{"a": "x"}, {"f": {"b": 1}}]
    for v in valid:
        assert Draft4Validator(schema).is_valid(v)
    for v in invalid:
        assert not Draft4Validator(schema).is_valid(v)
    check(cfg_remote, tokenizer, schema, valid, invalid)
    remote = {"$schema": D4, "id": BASE, "items": {"id": "folder/", "items": {"$ref": "../integer.json"}}}
    check(cfg_remote, tokenizer, remote, [[[1]]], [[["a"]]])
    # an `id` in a document of a later draft (or naming none) is a label: the base stays
    check(cfg_remote, tokenizer, dict(schema, **{"$schema": "http://json-schema.org/draft-06/schema#"}),
          [{"f": {"b": 1}}], [{"f": {"b": "x"}}])


def test_draft_04_ids_used_as_labels_still_compile(cfg_remote, tokenizer):
    # real-world draft-04 schemas use `id` as a name: read as a base, the pointer below would
    # look inside the schema named "x" (it has no definitions); such a schema is read with
    # its ids as labels, as before
    schema = {"$schema": D4, "definitions": {"x": {"id": "x", "properties": {"y": {"$ref": "#/definitions/z"}}},
                                             "z": {"type": "integer"}},
              "properties": {"p": {"$ref": "#/definitions/x"}}}
    check(cfg_remote, tokenizer, schema, [{"p": {"y": 1}}], [{"p": {"y": "s"}}])
    # a reference that resolves neither way is refused with the drafts' reading's reason
    broken = {"$schema": D4, "id": BASE + "d4/", "properties": {"p": {"$ref": "missing.json"}}}
    with pytest.raises(GrammarError, match="missing.json"):
        compile_(cfg_remote, broken)
