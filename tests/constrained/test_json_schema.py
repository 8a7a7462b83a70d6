"""The JSON Schema -> regex translation, checked against `jsonschema` on instances."""
import json
import re

import jsonschema
import pytest

from lmprog_runtime.constrained.json_schema import UnsupportedSchemaError, build_regex_from_schema
from lmprog_runtime.constrained.regex_fragments import integer_range, number_range


def dumps(v, pretty=False):
    if pretty:
        return json.dumps(v, ensure_ascii=False, indent=2)
    return json.dumps(v, ensure_ascii=False, separators=(",", ":"))


def check(schema, instances, **kw):
    """Each instance: accepted by the regex iff jsonschema says it is valid."""
    rx = re.compile(build_regex_from_schema(schema, **kw))
    for inst in instances:
        valid = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker()).is_valid(inst)
        assert bool(rx.fullmatch(dumps(inst))) == valid, (schema, inst, valid)


CASES = [
    ({"type": "integer"}, [0, -3, 17, 1.5, "1", None]),
    ({"type": "integer", "minimum": -5, "maximum": 120}, [-6, -5, 0, 99, 120, 121, 1000]),
    ({"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}, [0, 1, 9, 10]),
    ({"type": "number", "minimum": 0, "maximum": 1}, [0, 0.5, 1, 1.5, -0.1]),
    ({"type": "number", "exclusiveMinimum": -2}, [-2, -1.5, 3, -3]),
    ({"type": "string", "minLength": 2, "maxLength": 4}, ["a", "ab", "abcd", "abcde", "é€x", 'a"']),
    ({"type": "string", "pattern": "^[A-Z]{2}-[0-9]+$"}, ["AB-12", "ab-12", "AB-", "XAB-1"]),
    ({"type": "string", "pattern": "oo"}, ["foo", "bar", "oo", 'x"oo']),
    ({"type": "string", "pattern": "^[a-z]+$", "minLength": 3}, ["ab", "abc", "abC"]),
    ({"type": "string", "format": "date"}, ["2024-01-31", "2024-13-01", "24-01-01"]),
    ({"type": "string", "format": "uuid"}, ["123e4567-e89b-12d3-a456-426614174000", "123"]),
    ({"type": "string", "format": "ipv4"}, ["10.0.0.255", "10.0.0.256", "1.2.3"]),
    ({"type": ["string", "null"]}, ["x", None, 3]),
    ({"enum": ["a", 1, None, {"k": [1]}]}, ["a", 1, None, {"k": [1]}, "b", 2]),
    ({"const": "fixed"}, ["fixed", "other"]),
    ({"type": "boolean"}, [True, False, 0]),
    ({"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
     [[], [1], [1, 2, 3], [1, 2, 3, 4], ["a"]]),
    ({"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}], "items": False},
     [["a", 1], ["a"], [], ["a", 1, 2], [1, "a"]]),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
      "required": ["b"], "additionalProperties": False},
     [{"b": "x"}, {"a": 1, "b": "x"}, {"a": 1}, {}, {"b": 2}, {"a": 1, "b": "x", "c": 0}]),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": {"type": "string"}},
     [{"a": 1}, {"a": 1, "z": "s"}, {"z": "s"}, {"a": 1, "z": 2}, {"a": "s"}]),
    ({"type": "object", "patternProperties": {"^x-": {"type": "integer"}}, "additionalProperties": False},
     [{}, {"x-a": 1}, {"x-a": 1, "x-b": 2}, {"y": 1}, {"x-a": "s"}]),
    ({"type": "object", "properties": {"p": {"type": "integer"}}, "minProperties": 1},
     [{}, {"p": 1}]),
    ({"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 2}]}, [1, "ab", "abc", None]),
    ({"oneOf": [{"type": "integer"}, {"type": "boolean"}]}, [1, True, "x"]),
    ({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                {"properties": {"b": {"type": "boolean"}}, "required": ["b"]}]},
     [{"a": 1, "b": True}, {"a": 1}, {"b": True}]),
    ({"$defs": {"pos": {"type": "integer", "minimum": 1}},
      "type": "object", "properties": {"n": {"$ref": "#/$defs/pos"}}, "required": ["n"]},
     [{"n": 1}, {"n": 0}]),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "dependentRequired": {"a": ["b"]}}, [{}, {"b": 1}, {"a": 1, "b": 2}, {"a": 1}]),
    ({"type": "object", "properties": {"a": False, "b": {"type": "integer"}}}, [{}, {"b": 1}, {"a": 1}]),
    ({"type": "string"}, ["plain", "tab\there", "quote\"d", "back\\slash", "uni\u00e9\u4e2d", "\u0001"]),
]


@pytest.mark.parametrize("schema,instances", CASES, ids=[json.dumps(c[0])[:50] for c in CASES])
def test_translation_agrees_with_jsonschema(schema, instances):
    check(schema, instances)


def test_recursive_ref_is_bounded():
    schema = {"$defs": {"node": {"type": "object", "properties": {
        "v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
        "required": ["v"], "additionalProperties": False}}, "$ref": "#/$defs/node"}
    check(schema, [{"v": 1}, {"v": 1, "kids": [{"v": 2, "kids": []}]}, {"kids": []}])


def test_pretty_printed_json_passes_default_whitespace():
    schema = {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer"}},
                                               "b": {"type": "object", "properties": {"c": {"type": "null"}}}}}
    rx = build_regex_from_schema(schema)
    assert re.fullmatch(rx, dumps({"a": [1, 2], "b": {"c": None}}, pretty=True))
    assert not re.fullmatch(build_regex_from_schema(schema, whitespace_pattern=""), '{ "a": [] }')


def test_string_unicode_escapes_accepted():
    rx = build_regex_from_schema({"type": "string", "maxLength": 3})
    assert re.fullmatch(rx, r'"\u00e9\n"')
    assert not re.fullmatch(rx, r'"\u00e9\n\t\"x"')


@pytest.mark.parametrize("schema,feature", [
    ({"not": {"type": "string"}}, "not"),
    ({"type": "array", "uniqueItems": True}, "uniqueItems"),
    ({"if": {"type": "string"}, "then": {"minLength": 1}}, "if"),
    ({"type": "integer", "multipleOf": 3}, "multipleOf"),
    ({"$ref": "http://example.com/s.json"}, "$ref"),
    ({"type": "string", "pattern": "(?=a)b"}, "pattern"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf"),
    (False, "no instance"),
])
def test_unsupported_features_are_named(schema, feature):
    with pytest.raises(UnsupportedSchemaError, match=re.escape(feature)):
        build_regex_from_schema(schema)


def test_integer_range_exhaustive():
    for lo, hi in [(0, 0), (5, 123), (-50, 50), (-7, -3), (None, 5), (3, None), (-20, None), (10, 1000)]:
        rx = re.compile(integer_range(lo, hi))
        for v in range(-1100, 1100):
            expect = (lo is None or v >= lo) and (hi is None or v <= hi)
            assert bool(rx.fullmatch(str(v))) == expect, (lo, hi, v)


def test_number_range_quarters():
    values = [x / 4 for x in range(-40, 40)]
    for lo, hi, lx, hx in [(0, 5, False, False), (-3, 0, True, True), (None, -1, False, True), (2, None, True, False)]:
        rx = re.compile(number_range(lo, hi, lx, hx))
        for v in values:
            expect = (lo is None or (v > lo if lx else v >= lo)) and (hi is None or (v < hi if hx else v <= hi))
            text = str(int(v)) if v == int(v) else repr(v)
            assert bool(rx.fullmatch(text)) == expect, (lo, hi, lx, hx, text)


def test_missing_additional_properties_means_open():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    rx = re.compile(build_regex_from_schema(schema, ""))
    assert rx.fullmatch('{"a":1,"b":"x","c":[1,"d"],"e":{"f":null}}')  # undeclared keys, shallow values
    assert not rx.fullmatch('{"a":1,"a":"x"}')  # an undeclared key never repeats a declared one
    assert not rx.fullmatch('{"a":1,"b":[[1]]}')  # undeclared values nest extra_depth=1 deep
    closed = re.compile(build_regex_from_schema({**schema, "additionalProperties": False}, ""))
    assert closed.fullmatch('{"a":1}') and not closed.fullmatch('{"a":1,"b":2}')
    strict = re.compile(build_regex_from_schema(schema, "", extra_properties=False))
    assert not strict.fullmatch('{"a":1,"b":2}')
    bare = re.compile(build_regex_from_schema({"type": "object"}, ""))
    assert bare.fullmatch('{"x":{"y":[1,{"z":true}]}}')  # a bare object nests any_depth deep


def test_pattern_properties_without_additional_properties_narrow_to_patterns():
    schema = {"type": "object", "patternProperties": {"^x_": {"type": "integer"}}}
    rx = re.compile(build_regex_from_schema(schema, ""))
    assert rx.fullmatch('{"x_a":1,"x_b":2}')
    assert not rx.fullmatch('{"x_a":"s"}') and not rx.fullmatch('{"y":1}')
