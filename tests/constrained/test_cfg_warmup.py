"""Compile-time warm-up of cfg grammars (constrained/cfg/warmup.py): a compiled JSON Schema
grammar has walked a sample instance, so its first masks are cached; masks are the ones an
unwarmed grammar computes; the matcher is left at its start; the walk is bounded."""
import json
import re
import time

import numpy as np
import pytest

from lmprog_runtime.constrained import create_grammar_backend
from lmprog_runtime.constrained.cfg import warmup
from lmprog_runtime.constrained.cfg.backend import CfgGrammar, _Compiled, compile_machine
from lmprog_runtime.constrained.cfg.mask import MaskEngine
from lmprog_runtime.constrained.cfg.refs import RefIndex
from lmprog_runtime.constrained.cfg.registry import SchemaRegistry

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "born": {"type": "string", "format": "date"},
    "kind": {"enum": ["author", "editor"]}, "score": {"type": "number", "minimum": 0},
    "tags": {"type": "array", "items": {"type": "string"}},
    "home": {"$ref": "#/$defs/place"}}, "required": ["name", "kind"],
    "$defs": {"place": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "integer"}}}}}
INSTANCES = ['{"name":"Ann","kind":"editor","score":2.25,"tags":["a","b c"],"home":{"city":"Oslo","zip":150}}',
             '{\n  "kind": "author",\n  "name": "Bo \\"B\\"",\n  "born": "1999-12-31"\n}',
             '{"name":"x","kind":"writer"}']


@pytest.fixture(scope="module")
def cfg(tokenizer):
    be = create_grammar_backend("cfg", tokenizer, vocab_size=49152 + 64, eos_token_ids=[tokenizer.eos_token_id])
    yield be
    be.shutdown()


def _walked_along(cfg, tokenizer, g, text: str, monkeypatch) -> list:
    """The outputs at which `g`'s engine walks a mask (none memoized) along `text`'s tokens."""
    eng = g._shared.engine
    walked = []
    compute = eng._compute
    monkeypatch.setattr(eng, "_compute", lambda key, state, hist: walked.append(hist) or compute(key, state, hist))
    for t in tokenizer.encode(text, add_special_tokens=False):
        g.write_mask(np.empty(cfg.vocab_size, np.bool_))
        g.accept_token(t)
    return walked


def _unwarmed(cfg, spec: str) -> CfgGrammar:
    machine = compile_machine("json", spec, cfg.whitespace)
    return CfgGrammar(_Compiled(machine, MaskEngine(machine, cfg.vocab), cfg.table, cfg.eos_token_ids,
                                cfg.vocab_size))


def test_warmed_grammar_has_cached_masks_and_the_same_masks(cfg, tokenizer):
    spec = json.dumps(SCHEMA)
    warm = cfg.compile("json", spec)
    assert len(warm._states) == 1 and not warm._hist  # left at its start
    assert len(warm._shared.engine._memo) > 20  # the sample's states were walked
    cold = _unwarmed(cfg, spec)
    assert len(cold._shared.engine._memo) == 0
    a, b = np.empty(cfg.vocab_size, np.bool_), np.empty(cfg.vocab_size, np.bool_)
    compared = 0
    for text in INSTANCES:
        g, h = warm.copy(), cold.copy()
        for t in tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]:
            g.write_mask(a)
            h.write_mask(b)
            assert np.array_equal(a, b), (text, g._hist)
            compared += 1
            if not a[t]:
                break
            g.accept_token(t)
            h.accept_token(t)
    assert compared > 40


def test_sample_follows_the_schema():
    v0, v1 = warmup.sample(SCHEMA), warmup.sample(SCHEMA, alt=1)
    assert v0["kind"] == "author" and v1["kind"] == "editor" and v0["born"] == "2020-01-31"
    assert set(v0) == set(SCHEMA["properties"]) and set(v0["home"]) == {"city", "zip"}
    assert len(v1["tags"]) == 2 and isinstance(v1["score"], float)
    assert warmup.sample(False) is warmup._NONE
    assert set(warmup.sample(SCHEMA, required=True)) == {"name", "kind"}  # (outputs often hold just those)


def test_warmup_is_bounded(cfg):
    # every property refers back to the root: the sample's size is capped, not 24 ** depth
    recursive = {"type": "object", "properties": {f"p{i}": {"$ref": "#"} for i in range(24)}}
    t0 = time.perf_counter()
    g = cfg.compile("json", json.dumps(recursive))
    assert time.perf_counter() - t0 < 2.0 + warmup.WARMUP_S
    assert len(g._states) == 1
    v = warmup.sample(recursive)
    assert len(json.dumps(v)) < 50_000


def test_requests_arriving_together_share_one_compile(cfg):
    """Futures asked for one spec while its compile runs wait for that compile (each gets its
    own matcher) instead of compiling again beside it."""
    calls = []
    original = type(cfg).compile

    def counted(self, kind, spec):
        calls.append(spec)
        time.sleep(0.05)  # still compiling when the others ask
        return original(self, kind, spec)

    spec = json.dumps({"type": "object", "properties": {"shared": {"type": "integer"}}, "required": ["shared"]})
    type(cfg).compile = counted
    try:
        futures = [cfg.get_future("json", spec) for _ in range(4)]
        grammars = [f.result(timeout=60) for f in futures]
    finally:
        type(cfg).compile = original
    assert calls == [spec]
    assert len({id(g) for g in grammars}) == 4  # a matcher each
    assert all(len(g._states) == 1 for g in grammars)
    assert cfg.get_future("json", spec).result(timeout=5)._shared is grammars[0]._shared  # then cached


@pytest.mark.parametrize("pattern,least", [("^[a-fA-F0-9]{8}-[a-fA-F0-9]{4}$", None), ("^file:.+\\.geodatabase?$", None),
                                           ("abc", None), ("^(foo|bar)+baz$", None), ("^[a-z]+$", 5),
                                           ("^pbj:([a-z0-9-]+):([0-9]+-[0-9]+)$", None), ("^[^a-z]{2}$", None)])
def test_pattern_samples_match_their_patterns(pattern, least):
    text = warmup._pattern_text(pattern, least)
    assert text is not None and re.search(pattern, text), text
    assert len(text) >= (least or 0) and text.isprintable()


def test_pattern_sample_gives_up_where_it_cannot():
    assert warmup._pattern_text("(?=a)b", None) is None  # lookahead: refused by the compiler
    assert warmup._pattern_text("^a{5000}$", None) is None  # past PATTERN_STEPS


def test_sample_takes_the_schemas_own_values_and_patterns():
    schema = {"type": "object", "properties": {
        "id": {"type": "string", "pattern": "^[0-9]{3}$"}, "tag": {"type": "string", "examples": ["red"], "default": "x"},
        "n": {"type": "integer", "default": 7}, "s": {"type": "string", "default": 3}}}
    v0, v1 = warmup.sample(schema), warmup.sample(schema, alt=1)
    assert v0 == {"id": "000", "tag": "red", "n": 7, "s": "abc"}  # (a default of the wrong type is not taken)
    assert v1["tag"] == "Abc de-f 12" and v1["n"] == 0  # alt 1: not the schema's own value (a number: 0, no lower end)


def test_a_pattern_property_does_not_stop_the_walk(cfg, tokenizer, monkeypatch):
    """The sample of a pattern property meets the pattern, so the walk goes on to the keys
    after it: the next property's value start is cached when the first request asks."""
    monkeypatch.setattr(warmup, "WARMUP_S", 10.0)  # (what is walked, not how fast)
    schema = {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[a-f0-9]{8}$"},
                                               "name": {"type": "string"}}, "required": ["id", "name"]}
    g = cfg.compile("json", json.dumps(schema))
    for t in tokenizer.encode('{"id":"deadbeef","name":"', add_special_tokens=False):
        g.accept_token(t)
    eng = g._shared.engine
    walked = []
    compute = eng._compute
    monkeypatch.setattr(eng, "_compute", lambda key, state, hist: walked.append(state) or compute(key, state, hist))
    g.write_mask(np.empty(cfg.vocab_size, np.bool_))
    assert not walked


def test_sample_writes_undeclared_and_pattern_keys_where_allowed():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}},
              "additionalProperties": {"type": "integer", "minimum": 5}}
    assert warmup.sample(schema) == {"a": 1}
    assert warmup.sample(schema, alt=1) == {"a": 0, "extra_key": 6}  # (alt 1 only: outputs mostly keep to the names)
    # (a missing one allows any: a string, a value whose start is a token of its own, an object)
    assert warmup.sample({"type": "object"}, alt=1) == {"extra_key": "abc", "extra_num": 1,
                                                        "extra_obj": {"a": "abc", "b": True}}
    assert warmup.sample(dict(schema, additionalProperties=False), alt=1) == {"a": 0}
    # (a pattern key of 12 characters where one matches, else 6, else the shortest)
    assert warmup.sample({"type": "object", "patternProperties": {"^x_[0-9]+$": {"type": "boolean"}},
                          "additionalProperties": False}, alt=1) == {"x_0000000000": True}
    assert warmup.sample({"type": "object", "patternProperties": {"^[a-z]{1,8}$": {"type": "boolean"}},
                          "additionalProperties": False}, alt=1) == {"aaaaaa": True}
    assert warmup.sample({"type": "object", "patternProperties": {"^[a-z]{1,8}$": {"type": "boolean"}},
                          "additionalProperties": False}) == {}
    assert warmup.sample(schema, alt=1, required=True) == {"a": 0}


def test_sample_writes_an_item_past_the_prefix_where_allowed():
    tup = {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}]}
    assert warmup.sample(tup) == [1, "abc"]
    assert len(warmup.sample(tup, alt=1)) == 3  # (alt 1: one of `items`, any value without one)
    assert warmup.sample(dict(tup, items={"type": "boolean"}), alt=1)[2] is True
    assert len(warmup.sample(dict(tup, items=False), alt=1)) == 2
    assert len(warmup.sample(dict(tup, maxItems=2), alt=1)) == 2


def test_sample_enum_members_of_the_schemas_type():
    """An enum member the schema's type refuses is no sample (a walk would stop there)."""
    schema = {"type": "object", "properties": {"kind": {"enum": ["A", "B"], "type": "object"},
                                               "n": {"enum": ["x", 2, 3.5], "type": "integer"}, "s": {"enum": ["p", 1]}}}
    assert warmup.sample(schema) == {"n": 2, "s": "p"}
    assert warmup.sample(schema, alt=1) == {"n": 2, "s": 1, "extra_key": "abc", "extra_num": 1,
                                            "extra_obj": {"a": "abc", "b": True}}


def test_sample_joins_all_of_branches_and_required_keys_not_declared():
    """Every allOf branch holds, so the sample has each one's properties and required keys;
    a required key no `properties` declares gets a value of additionalProperties' schema."""
    schema = {"type": "object", "allOf": [{"properties": {"a": {"type": "integer"}}},
                                          {"$ref": "#/$defs/b"}, {"required": ["c"]}],
              "$defs": {"b": {"properties": {"b": {"type": "boolean"}}, "required": ["b"]}}}
    assert warmup.sample(schema) == {"a": 1, "b": True, "c": {"a": "abc", "b": 1}}
    assert warmup.sample(dict(schema, additionalProperties={"type": "string"})) == {"a": 1, "b": True, "c": "abc"}
    assert warmup.sample(dict(schema, additionalProperties=False)) == {"a": 1, "b": True}
    assert warmup.sample(schema, required=True) == {"b": True, "c": {"a": "abc", "b": 1}}


def test_sample_keeps_the_siblings_of_a_reference_and_writes_keys_unevaluated_properties_allows():
    """A `$ref`'s siblings hold too (2019-09 on: as an allOf's branches), so the sample has
    the properties of both; beside no additionalProperties, an undeclared key gets a value
    of unevaluatedProperties' schema (none where that is false)."""
    schema = {"$ref": "#/$defs/b", "properties": {"foo": {"type": "string"}}, "unevaluatedProperties": False,
              "$defs": {"b": {"properties": {"bar": {"type": "integer"}}}}}
    assert warmup.sample(schema) == {"foo": "abc", "bar": 1}
    assert warmup.sample(schema, alt=1) == {"foo": "Abc de-f 12", "bar": 0}
    opened = {"type": "object", "properties": {"foo": {"type": "string"}}, "unevaluatedProperties": {"type": "integer"}}
    assert warmup.sample(opened, alt=1) == {"foo": "Abc de-f 12", "extra_key": 0}


def test_sample_meets_if_then_and_else_and_dependent_schemas():
    """The first samples meet an `if` and take its `then`; the alternative one takes its
    `else`; every dependentSchemas branch's properties are written (their key likely is)."""
    schema = {"if": {"properties": {"foo": {"const": "then"}}, "required": ["foo"]},
              "then": {"properties": {"bar": {"type": "string"}}, "required": ["bar"]},
              "else": {"properties": {"baz": {"type": "integer"}}, "required": ["baz"]},
              "dependentSchemas": {"bar": {"properties": {"qux": {"type": "boolean"}}}}}
    assert warmup.sample(schema) == {"foo": "then", "bar": "abc", "qux": True}
    assert warmup.sample(schema, alt=1) == {"baz": 0, "qux": True, "extra_key": "abc", "extra_num": 1,
                                            "extra_obj": {"a": "abc", "b": True}}


def test_sample_keeps_the_properties_beside_a_choice_and_follows_any_reference():
    """An anyOf / oneOf branch sampled keeps the properties written beside the choice; a
    `$ref` is resolved as the compiler resolves it (relative URIs against the `$id`s around
    it, remote documents from the registry), a `$dynamicRef` to its static target."""
    choice = {"properties": {"foo": {"type": "string"}},
              "anyOf": [{"properties": {"bar": {"const": "bar"}}, "required": ["bar"]},
                        {"properties": {"baz": {"type": "integer"}}, "type": "object"}]}
    assert warmup.sample(choice) == {"foo": "abc", "bar": "bar"}
    v1 = warmup.sample(choice, alt=1)  # (the last branch; undeclared keys too: alt 1 writes them)
    assert v1["foo"] == "Abc de-f 12" and v1["baz"] == 0 and "bar" not in v1
    doc = {"$id": "http://x.test/root", "$ref": "list",
           "$defs": {"list": {"$id": "list", "type": "array", "items": {"$ref": "item"}},
                     "item": {"$id": "item", "type": "object", "properties": {"n": {"$dynamicRef": "#num"}},
                              "$defs": {"num": {"$dynamicAnchor": "num", "type": "integer"}}}}}
    assert warmup.sample(doc) is None  # (the document alone: no relative reference resolves)
    assert warmup.sample(doc, RefIndex(doc)) == [{"n": 1}]
    remote = {"type": "object", "properties": {"p": {"$ref": "http://x.test/root#/$defs/item"}}}
    registry = SchemaRegistry()
    registry._docs["http://x.test/root"] = doc
    assert warmup.sample(remote, RefIndex(remote, registry)) == {"p": {"n": 1}}


def test_samples_take_several_enum_members():
    schema = {"type": "object", "properties": {"d": {"enum": ["N", "E", "S", "W"]}}}
    assert [warmup.sample(schema, alt=1)["d"], warmup.sample(schema)["d"], warmup.sample(schema, negative=True)["d"],
            warmup.sample(schema, required=True)["d"]] == ["W", "N", "E", "S"]
    assert warmup.sample({"enum": ["N", "E", "S", "W"]}, required=True) == "S"


def test_sample_negative_numbers_where_no_minimum_forbids_them():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "number", "minimum": 2},
                                               "c": {"type": "number", "default": 7}}}
    # (no sign where a minimum forbids it: a 1 and more digits than the minimum has)
    assert warmup.sample(schema, negative=True) == {"a": -1, "b": 12, "c": 7}
    assert warmup.sample({"type": "integer", "minimum": 60, "maximum": 100}, negative=True) == 60
    assert warmup.sample({"type": "integer", "minimum": 60}, negative=True) == 122
    # (the alternative's 0 is 1 where the schema's own value, the first sample's, is 0)
    assert warmup.sample({"type": "number", "default": 0}, alt=1) == 1.5
    assert warmup.sample({"type": "number", "default": 3}, alt=1) == 0.5
    assert warmup.sample(schema) == {"a": 1, "b": 2, "c": 7}


def test_sample_numbers_between_bounds_and_any_values():
    """The alternative sample writes a bounded number between its bounds with more digits
    than the minimum (states most numbers within them share: canonical._number_class) or
    past a minimum alone (a free number's digits there: canonical._met_minimum), and
    a value of any kind is an object or an array of other kinds, not `null`."""
    schema = {"type": "object", "properties": {"p": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "g": {"type": "number", "minimum": -127, "maximum": 128},
                                               "x": {"description": "anything", "modes": {"type": "array"}}},
              "additionalProperties": False}
    assert warmup.sample(schema) == {"p": 0, "g": -127, "x": {"a": "abc", "b": 1}}
    assert warmup.sample(schema, alt=1) == {"p": 59, "g": 26.5, "x": ["abc", 0.5, {"c": "abc", "d": True}]}
    assert warmup.sample({"type": "number", "minimum": 0}, alt=1) == 1.5  # (past a minimum alone)
    counted = {"type": "string", "pattern": "^@(\\w){1,15}$"}  # (alt: a longer match, its count's states)
    assert warmup.sample(counted) == "@0" and len(warmup.sample(counted, alt=1)) == warmup.ALT_PATTERN_CHARS
    assert warmup.sample({"type": "string", "pattern": "^x{2}$"}, alt=1) == "xx"  # (none that long: the shortest)
    items = {"type": "array", "minItems": 1, "items": {"type": "integer"}}  # (alt: a second item's state)
    assert warmup.sample(items) == [1] and warmup.sample(items, alt=1) == [0, 0]
    assert warmup.sample(dict(items, maxItems=1), alt=1) == [0] and warmup.sample(dict(items, minItems=0)) == []
    members = {"type": "array", "items": {"enum": ["a", "b", 3, "c"], "type": "string"}, "maxItems": 2}
    assert warmup.sample(members) == ["a"] and warmup.sample(members, alt=1) == ["a", "b"]  # (each member's states)
    assert warmup.sample(schema, negative=True)["x"] == {"a": -1, "b": [1, "x"]}
    assert warmup.sample(schema, required=True)["x"] is None
    assert warmup.sample({"type": "array", "items": True}) == [{"a": "abc", "b": 1}]


def test_samples_write_dates_and_times_with_other_first_digits():
    """The three samples' dates and times start their month, day and hour with other digits
    and have a month of each length (a date pattern's states differ by them: formats.py
    counts each month's days), each a valid value of its format."""
    from lmprog_runtime.constrained.cfg.backend import accepts_text, compile_machine
    schema = {"type": "object", "properties": {"d": {"type": "string", "format": "date"},
                                               "t": {"type": "string", "format": "date-time"},
                                               "h": {"type": "string", "format": "time"}}}
    got = [warmup.sample(schema), warmup.sample(schema, alt=1), warmup.sample(schema, negative=True)]
    assert len({v["d"][5] + v["d"][8] for v in got}) == 3 and len({v["h"][0] for v in got}) == 3
    months = {v["d"][5:7] for v in got} | {v["t"][5:7] for v in got}
    assert "02" in months and months & {"04", "06", "09", "11"} and months & {"01", "03", "05", "07", "08", "10", "12"}
    machine = compile_machine("json", json.dumps(schema), "[ \t\n\r]*")
    for v in got:
        assert accepts_text(machine, json.dumps(v)), v
    assert not accepts_text(machine, json.dumps({"t": "2021-10-05T25:59:59Z"}))  # (the formats are checked)


def test_an_undeclared_key_is_walked(cfg, tokenizer, monkeypatch):
    """An object open to other keys: the masks inside an undeclared key (shared by every such
    key, MaskEngine._key_near) and at its value's start are cached when the first request asks."""
    monkeypatch.setattr(warmup, "WARMUP_S", 10.0)  # (what is walked, not how fast)
    schema = {"type": "object", "properties": {"tags": {"type": "object", "additionalProperties": {"type": "string"}}}}
    g = cfg.compile("json", json.dumps(schema))
    walked = _walked_along(cfg, tokenizer, g, '{"tags":{"fb_user_id":"1234","sales', monkeypatch)
    assert len(walked) <= 1, walked  # (the value's string body after its first character may be new)


def test_pattern_samples_are_bounded(cfg, monkeypatch):
    """Pattern texts are searched only until SAMPLE_S after a sample began (then patterns get
    "abc"), so a schema of many patterns compiles in bounded time."""
    schema = {"type": "object", "properties": {
        f"p{i}": {"type": "string", "pattern": f"^(a|b){{{i % 40 + 1}}}[0-9]{{3}}x{i}$", "minLength": 1}
        for i in range(300)}}
    assert all(re.search(schema["properties"][k]["pattern"], v) for k, v in warmup.sample(schema).items())
    warmup._pattern_text.cache_clear()
    monkeypatch.setattr(warmup, "SAMPLE_S", 0.0)
    assert set(warmup.sample(schema).values()) == {"abc"}
    t0 = time.perf_counter()
    cfg.compile("json", json.dumps(schema))
    assert time.perf_counter() - t0 < 2.0 + warmup.WARMUP_S


def test_sample_without_type_takes_the_kind_its_keywords_describe():
    assert warmup.sample({"minimum": 5}) == 5 and warmup.sample({"maxLength": 2}) == "ab"
    assert warmup.sample({"minItems": 1, "uniqueItems": True}) == [{"a": "abc", "b": 1}]
    assert warmup.sample({"required": ["a"]}) == {"a": {"a": "abc", "b": 1}} and warmup.sample({"not": {"type": "null"}}) is None


def test_a_fifth_sample_turns_the_first():
    """The first sample with its keys in reverse order and one-item arrays doubled (keys
    in another order, later items: states of their own)."""
    got = warmup._turned({"a": 1, "b": [{"c": 1, "d": "x"}], "e": [1, 2]})
    assert json.dumps(got) == json.dumps({"e": [1, 2], "b": [{"d": "x", "c": 1}, {"d": "x", "c": 1}], "a": 1})


def test_warmup_deadline_leaves_out_garbage_collections():
    """A full collection (in a process holding many grammars, a fifth of a second) does not
    count against WARMUP_S: it would otherwise end the walk and leave the masks to the
    first request."""
    import gc
    import time
    junk = [[k] for k in range(300_000)]  # (tracked objects: a full collection takes a while)
    wall, clock = time.monotonic(), warmup._clock()
    gc.collect()
    wall, clock = time.monotonic() - wall, warmup._clock() - clock
    assert wall > 0.002 and clock < wall / 2, (wall, clock)
    del junk


def test_a_schema_without_type_walks_a_value_of_each_kind(cfg, tokenizer, monkeypatch):
    """`{"minimum": 1}` takes any string, object, array, boolean or null: the warm-up walks
    one of each, so those values' first masks are cached."""
    g0 = cfg.compile("json", json.dumps({"minimum": 1, "$comment": "kinds"}))
    eng = g0._shared.engine
    walked = []
    compute = eng._compute
    monkeypatch.setattr(eng, "_compute", lambda key, state, hist: walked.append(state) or compute(key, state, hist))
    row = np.empty(cfg.vocab_size, np.bool_)
    for text in ('"abc"', "12", "true", "null", '{"x":"y","z":7}'):  # (an undeclared key's `":` then a number)
        g = g0.copy()
        for t in tokenizer.encode(text, add_special_tokens=False):
            g.write_mask(row)
            assert row[t]
            g.accept_token(t)
    assert not walked


def test_kind_samples_put_each_kind_where_any_value_may_stand():
    """Samples `pick` 1..KINDS write, where any value may stand (a free property, an
    array's free items, an open object with nothing declared, one type of a list), a
    value of each kind in turn: a number, a string, an array of two, a boolean, null, an
    object, a fraction below zero; arrays get two items (the state after a comma)."""
    schema = {"type": "object", "properties": {"free": {}, "list": {"type": "array"}, "n": {"type": "integer"}}}
    kinds = [warmup.sample(schema, pick=k) for k in range(1, warmup.KINDS + 1)]
    assert [v["free"] for v in kinds] == list(warmup._ANY_KINDS)
    assert [v["list"] for v in kinds] == [[x, x] for x in warmup._ANY_KINDS]
    assert all(v["n"] == 1 and set(v) == {"free", "list", "n"} for v in kinds)  # (declared: no key added)
    assert warmup.sample({"type": "object"}, pick=1) == {"extra_key": 12}
    assert [warmup.sample({"type": ["array", "string"]}, pick=k) for k in (1, 2)] == ["abc", ["abc", "abc"]]


def test_a_property_no_value_satisfies_is_left_out_of_the_samples():
    """A property whose schema no value satisfies (`false`, `{"not": {}}`) is left out of
    the samples, so the walk goes on to the members after it instead of stopping at it."""
    schema = {"type": "object", "properties": {"foo": {"not": {}}, "bar": False, "baz": {"type": "integer"}}}
    assert warmup.sample(schema) == {"baz": 1}
    assert "foo" not in warmup.sample(schema, alt=1) and "extra_key" in warmup.sample(schema, alt=1)


def test_a_sample_refused_inside_a_member_is_walked_again_without_it(cfg, tokenizer, monkeypatch):
    """A sample a check refuses (here `"abc"` under `not: {const: "abc"}`) stops the walk at
    the refused token; the compact sample is walked again without the member holding it, so
    the members after it are walked too (`_without_member_at`)."""
    monkeypatch.setattr(warmup, "WARMUP_S", 10.0)  # (what is walked, not how fast)
    value = {"a": "abc", "n": {"b": [1, {"c": True}], "d": 2}}
    text = json.dumps(value, separators=(",", ":"))
    assert warmup._without_member_at(value, text.index('"abc"')) == {"n": {"b": [1, {"c": True}], "d": 2}}
    assert warmup._without_member_at(value, text.index("true")) == {"a": "abc", "n": {"b": [1, {}], "d": 2}}
    assert warmup._without_member_at(value, 0) is None and warmup._without_member_at(value, len(text) - 1) is None
    schema = {"type": "object", "properties": {"a": {"type": "string", "not": {"const": "abc"}},
                                               "count": {"type": "integer"}}}
    texts = []
    encode = cfg.sample_tokenizer.encode
    monkeypatch.setattr(cfg.sample_tokenizer, "encode", lambda text: texts.append(text) or encode(text))
    g = cfg.compile("json", json.dumps(schema))
    assert texts[0] == '{"a":"abc","count":1}' and '{"count":1}' in texts  # (the first, then it pruned)
    assert not _walked_along(cfg, tokenizer, g, '{"count":1}', monkeypatch)


def test_an_object_closed_by_property_names_samples_one_of_its_names():
    """Under a propertyNames enum (or const) the alternative sample's undeclared member takes
    one of its names (any other key would be refused), under its pattern one of the
    pattern's matches, with a value of additionalProperties."""
    schema = {"propertyNames": {"enum": ["foo", "bar"]}, "additionalProperties": {"type": "integer"}}
    assert warmup.sample(schema) == {} and warmup.sample(schema, alt=1) == {"foo": 0}
    assert warmup.sample({"type": "object", "properties": {"foo": {"type": "string"}},
                          "propertyNames": {"enum": ["foo", "bar"]}}, alt=1) == {"foo": "Abc de-f 12", "bar": "abc"}
    assert warmup.sample({"propertyNames": {"maxLength": 3}}, alt=1) == {}
    # (under a propertyNames pattern: one of its matches)
    assert warmup.sample({"propertyNames": {"pattern": "^a+$"}}, alt=1) == {"a": "abc"}
    assert warmup.sample({"propertyNames": {"pattern": "^x[0-9]$"}, "additionalProperties": {"type": "integer"}},
                         pick=1) == {"x0": 1}


@pytest.mark.parametrize("schema,text", [({"const": 0}, "0.0"), ({"maximum": 300}, "300.0"), ({"enum": [1, "a"]}, "1.0"),
                                         ({"type": "integer", "multipleOf": 7}, "7.0"), ({"items": {"minimum": 2}}, "[10, 2.5, 3]")])
def test_number_parts_of_a_rules_own_numbers_are_made_at_compile(cfg, tokenizer, schema, text):
    """Each text of a number is a state of its own (a digit a token): the number parts along
    the rule's own numbers (its bounds, enum members, each with `.0`) and the first texts of
    every rule are made by the warm-up, and a request walking them makes none; its masks are
    an unwarmed grammar's."""
    spec = json.dumps(schema)
    warm, cold = cfg.compile("json", spec), _unwarmed(cfg, spec)
    made = len(warm._shared.engine._numbers)
    assert made > 3 and len(cold._shared.engine._numbers) == 0
    a, b = np.empty(cfg.vocab_size, np.bool_), np.empty(cfg.vocab_size, np.bool_)
    g, h = warm.copy(), cold.copy()
    for t in tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]:
        g.write_mask(a)
        h.write_mask(b)
        assert np.array_equal(a, b) and a[t], g._hist
        if t != tokenizer.eos_token_id:
            g.accept_token(t)
            h.accept_token(t)
    assert len(warm._shared.engine._numbers) == made
    assert len(cold._shared.engine._numbers) > 0


def test_number_seeds_are_a_rules_own_numbers_in_plain_notation():
    from decimal import Decimal

    from lmprog_runtime.constrained.cfg.nodes import Node
    node = Node()
    node.lo, node.hi, node.multiple_of = Decimal("-2.5"), Decimal("3E+2"), Decimal("0.0001")
    node.num_enum = (Decimal("9007199254740992"), Decimal("1E+30"), Decimal("0"))
    assert warmup._number_seeds(node) == ["-2.5", "300", "300.0", "0.0001", "9007199254740992",
                                          "9007199254740992.0", "0", "0.0"]
