"""No dead ends in the cfg engine: every prefix the mask lets through can still be
completed to a valid instance, so sampling never wanders where nothing valid follows.

- Numbers under an `enum` / `const` follow only digits that can still spell one of the
  enum's numbers (any spelling JSON allows: `1.0`, `10e-1`, `0.1E1`); before, the enum was
  checked on the complete value only, and a model could write `441.000...` until its length
  ran out.
- Numbers under bounds follow only digits after which a number within them can still be
  written: a prefix's values are told exactly (`9` is 9 or 9.x, 90-99, ... never 10), where
  before a closed interval let an integer in [10, 50] start with `9` and then offered
  nothing at all.
- A literal (`true`, `false`, `null`) whose value a pending check reads (a whole-value
  check, a uniqueItems item) is refused at its first byte where the check fails on it: its
  end is certain, so `nu` under `{"not": {"type": "null"}}` was a token with nothing after.
- In a uniqueItems array whose items have few values (literals, an enum), an item is begun
  under the values not seen yet, and no comma follows once all are seen.
- Objects and arrays in an enum are their literal structure.
- A string whose pattern takes no more characters refuses a backslash (an escape spells one
  more character); before, `\\` was allowed there and `\\u` led to an empty mask, which a
  verify step then sampled from (NaN probabilities, the request failed).
"""
import json
from decimal import Decimal

import jsonschema
import pytest
import torch

from lmprog_runtime.constrained import create_grammar_backend
from lmprog_runtime.constrained.cfg.nodes import _enum_exponent_ok, _enum_mantissa_ok


@pytest.fixture(scope="module")
def cfg(tokenizer):
    be = create_grammar_backend("cfg", tokenizer, vocab_size=49152 + 64, eos_token_ids=[tokenizer.eos_token_id])
    yield be
    be.shutdown()


def _grammar(be, schema):
    return be.get_future("json", json.dumps(schema)).result(timeout=60)


def _assert_offered(be, tokenizer, schema, prefix: str, refused: list, allowed: list) -> None:
    """After `prefix`, the mask offers each one-token text of `allowed` and none of `refused`."""
    g = _grammar(be, schema).copy()
    for t in tokenizer.encode(prefix, add_special_tokens=False):
        g.accept_token(t)
    row = torch.zeros(be.vocab_size, dtype=torch.bool)
    g.fill_mask(row)
    for text in refused + allowed:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert len(ids) == 1, text
        assert bool(row[ids[0]]) == (text in allowed), (schema, prefix, text)


def _accepts(be, tokenizer, schema, text) -> bool:
    g = _grammar(be, schema)
    row = torch.zeros(be.vocab_size, dtype=torch.bool)
    for t in tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]:
        row.numpy().fill(False)
        g.fill_mask(row)
        if not row[t]:
            return False
        g.accept_token(t)
    return True


@pytest.mark.parametrize("text, value, exponent, ok", [
    ("", Decimal(22), True, True), ("-", Decimal(22), True, False), ("2", Decimal(22), True, True),
    ("0.00", Decimal(22), True, True), ("0.0022", Decimal(22), True, True), ("0.0023", Decimal(22), True, False),
    ("220", Decimal(22), True, True), ("2201", Decimal(22), True, False), ("4", Decimal(22), True, False),
    ("-2.5", Decimal("-25"), True, True), ("2.5", Decimal("-25"), True, False),
    ("0.000", Decimal(0), True, True), ("-0.0", Decimal(0), True, True), ("0.01", Decimal(0), True, False),
    ("33", Decimal(333), False, True), ("333.", Decimal(333), False, True), ("33.", Decimal(333), False, False),
    ("3334", Decimal(333), False, False), ("0", Decimal(0), False, True), ("1", Decimal("1.5"), False, False),
])
def test_mantissa_prefixes(text, value, exponent, ok):
    assert _enum_mantissa_ok(text, value, exponent) is ok


@pytest.mark.parametrize("text, value, ok", [
    ("1e", Decimal(100), True), ("1e2", Decimal(100), True), ("1e3", Decimal(100), False),
    ("1e+00", Decimal(100), True), ("1e-", Decimal(100), False), ("10e-", Decimal(1), True),
    ("10e-1", Decimal(1), True), ("10e-2", Decimal(1), False), ("2e", Decimal(100), False),
    ("0e", Decimal(0), True), ("0e", Decimal(5), False), ("-1E1", Decimal(-10), True), ("1E1", Decimal(-10), False),
    ("2.5e", Decimal("0.25"), True), ("2.5e-1", Decimal("0.25"), True), ("1e0", Decimal(1), True),
    ("1e1", Decimal(1), False),
])
def test_exponent_prefixes(text, value, ok):
    assert _enum_exponent_ok(text, value) is ok


def test_integer_enum_spellings(cfg, tokenizer):
    schema = {"type": "object", "properties": {"a": {"type": "integer", "enum": [1, 22, 333]}},
              "required": ["a"], "additionalProperties": False}
    for a in ("1", "22", "333", "1.0", "22.000", "333.0"):
        assert _accepts(cfg, tokenizer, schema, '{"a": %s}' % a), a
    for a in ("2", "4", "221", "3330", "1.5", "-1", "1e0"):  # integers take no exponent here
        assert not _accepts(cfg, tokenizer, schema, '{"a": %s}' % a), a


def test_number_enum_spellings(cfg, tokenizer):
    schema = {"enum": [0.25, 100, -3, "x", None]}
    for text in ("0.25", "2.5e-1", "25E-2", "100", "1e2", "1.00E+2", "-3", "-30e-1", '"x"', "null"):
        assert _accepts(cfg, tokenizer, schema, text), text
    for text in ("0.26", "2.5e-2", "1e3", "3", "-3.5", '"y"', "true"):
        assert not _accepts(cfg, tokenizer, schema, text), text


def _first_numbers(be, tokenizer, schema):
    g = _grammar(be, schema)
    row = torch.zeros(be.vocab_size, dtype=torch.bool)
    g.fill_mask(row)
    texts = {tokenizer.decode([t]) for t in row.nonzero().view(-1).tolist() if t != tokenizer.eos_token_id}
    return {s for s in texts if s.strip()[:1].isdigit()}


def test_first_digits_follow_the_enum(cfg, tokenizer):
    """An integer's digits must spell the value; a number's may start `0.` (0.333e3)."""
    assert _first_numbers(cfg, tokenizer, {"type": "integer", "const": 333}) == {"3"}
    assert _first_numbers(cfg, tokenizer, {"const": 333}) == {"0", "3"}


def test_object_and_array_constants_are_structure(cfg, tokenizer):
    """An enum of objects / arrays is their structure (keys in any order, numbers in any
    spelling), so a model cannot start an object no enum value matches."""
    schema = {"enum": [{"a": 1, "b": [True, "x"]}, [1, 2], "s"]}
    for text in ('{"a": 1, "b": [true, "x"]}', '{"b": [true, "x"], "a": 1.0}', "[1, 2]", "[1.0,2e0]", '"s"'):
        assert _accepts(cfg, tokenizer, schema, text), text
    for text in ('{"a": 1}', '{"a": 1, "b": [true, "x"], "c": 0}', "[1]", "[1, 2, 3]", "[2, 1]", '"t"', "1"):
        assert not _accepts(cfg, tokenizer, schema, text), text
    g = _grammar(cfg, schema)
    for t in tokenizer.encode('{"', add_special_tokens=False):
        g.accept_token(t)
    row = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    g.fill_mask(row)
    firsts = {tokenizer.decode([t])[:1] for t in row.nonzero().view(-1).tolist()}
    assert firsts <= {"a", "b", "\\"}, sorted(firsts)  # a key of the constant (or an escape spelling one)


def test_no_escape_after_a_full_pattern(cfg, tokenizer):
    schema = {"type": "string", "pattern": "^[A-Fa-f\\d]{4}$"}
    assert _accepts(cfg, tokenizer, schema, '"ab\\u0063d"')  # an escape spelling the 3rd character
    g = _grammar(cfg, schema)
    for t in tokenizer.encode('"abcd', add_special_tokens=False):
        g.accept_token(t)
    row = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    g.fill_mask(row)
    allowed = [tokenizer.decode([t]) for t in row.nonzero().view(-1).tolist()]
    assert allowed and all(a.startswith('"') for a in allowed), allowed[:20]  # only the closing quote


_BOUNDS = [({"minimum": 10, "maximum": 50}, ""), ({"exclusiveMinimum": 10, "maximum": 50}, ""),
           ({"minimum": 10, "exclusiveMaximum": 50}, ""), ({"minimum": -7.5, "maximum": 2.5}, ""),
           ({"exclusiveMinimum": 0.5, "exclusiveMaximum": 1.5}, ""), ({"minimum": -50, "maximum": -10}, ""),
           ({"minimum": 5}, ""), ({"maximum": -5}, ""), ({"minimum": 9.5, "maximum": 12}, "integer")]


@pytest.mark.parametrize("bounds,kind", _BOUNDS)
@pytest.mark.parametrize("number", ["integer", "number"])
def test_bounded_number_prefixes_are_exactly_those_that_complete(bounds, kind, number):
    """number_prefix_ok against brute force: a prefix (sign, digits, fraction) of up to three
    characters passes iff some number within the bounds starts with it (bounds in halves
    under 100: one of at most four characters does, where any does)."""
    import itertools

    from lmprog_runtime.constrained.cfg.backend import compile_machine
    schema = dict(bounds, type=kind or number)
    node = compile_machine("json", json.dumps(schema), "").root
    whole = node.integer_only()

    def complete(text: str) -> bool:
        try:
            value = Decimal(text)
        except ArithmeticError:
            return False
        return (not text.endswith((".", "-")) and node.number_ok(text)
                and (not whole or value == value.to_integral_value()))

    alphabet = "0123456789.-"
    texts = [p for n in range(1, 5) for p in map("".join, itertools.product(alphabet, repeat=n))
             if _json_number_prefix(p)]
    valid = [t for t in texts if complete(t)]
    for p in texts:
        if len(p) > 3 or (whole and "." in p and p.split(".")[1].strip("0")):
            continue
        assert node.number_prefix_ok(p) == any(v.startswith(p) for v in valid), (schema, p)


def _json_number_prefix(text: str) -> bool:
    """A prefix of a JSON number without exponent (`-`, `0`, `-0.`, `12.5`)."""
    import re
    return re.fullmatch(r"-?(0|[1-9][0-9]*)?(\.[0-9]*)?", text) is not None and not re.fullmatch(r"-?\..*", text)


@pytest.mark.parametrize("schema,prefix,refused,allowed", [
    ({"not": {"type": "null"}}, "", ["n", "nu", "null"], ["t", "tr", "f", "1", '"', "{"]),
    ({"type": "array", "uniqueItems": True}, "[true,false,", ["t", "tr", "true", "f", "fal"], ["n", "nu", "1"]),
    ({"oneOf": [{"type": "boolean"}, {"const": True}]}, "", ["t", "tr", "true"], ["f", "fal"]),
])
def test_literals_a_check_refuses_are_refused_at_their_first_byte(cfg, tokenizer, schema, prefix, refused, allowed):
    _assert_offered(cfg, tokenizer, schema, prefix, refused, allowed)


@pytest.mark.parametrize("schema,prefix,refused,allowed", [
    ({"type": "array", "items": {"enum": [1, 2]}, "uniqueItems": True}, "[1,", ["1"], ["2", "0"]),  # (0.2e1)
    ({"type": "array", "items": {"enum": [1, 2]}, "uniqueItems": True}, "[1,2", [","], ["]", "."]),
    ({"type": "array", "items": {"type": "boolean"}, "uniqueItems": True}, "[true,false", [","], ["]"]),
    ({"type": "array", "items": {"type": "null"}, "uniqueItems": True}, "[null", [","], ["]"]),
    ({"type": "array", "items": {"enum": ["abc", "x"]}, "uniqueItems": True}, '["abc","', ["a", "ab", "abc"], ["x"]),
    ({"type": "array", "items": {"enum": [1, 2.5, "x"]}, "uniqueItems": True}, '[2.50,"x",', ['"', "2"], ["1", "0"]),
    ({"type": "array", "prefixItems": [{"const": 1}], "items": {"enum": [1, 2]}, "uniqueItems": True}, "[1,2",
     [","], ["]"]),
])
def test_unique_items_of_few_values_refuse_a_seen_one_at_its_first_byte(cfg, tokenizer, schema, prefix, refused,
                                                                          allowed):
    """In a uniqueItems array whose item rule has few values (literals, an enum), an item
    is begun under those not seen yet (machine.py _unseen: `[1,1` under enum [1, 2] was a
    number only a seen value's spellings could finish, `["abc","a` a string only `"abc"`
    could), and no comma follows once every value is seen (`_exhausted`: `[true,false,`
    had nothing after it)."""
    _assert_offered(cfg, tokenizer, schema, prefix, refused, allowed)
    for value in ([1, 2], [2, 1], [True, False], [None], ["abc", "x"], ["x", "abc"], [2.5, "x", 1], [1, 1], ["x", "x"]):
        validator = jsonschema.validators.validator_for(schema)(schema)
        assert _accepts(cfg, tokenizer, schema, json.dumps(value)) == validator.is_valid(value), (schema, value)


@pytest.mark.parametrize("schema,refused,allowed", [
    ({"type": "object", "enum": [1, "a", None, [1], {"a": 1}]}, ["[", "1", '"', "n"], ["{"]),
    ({"type": ["string", "null"], "enum": [[True], "x", {"a": 1}]}, ["[", "{", "n"], ['"']),
])
def test_an_enum_member_not_of_the_schemas_type_begins_no_value(cfg, tokenizer, schema, refused, allowed):
    """An enum of objects / arrays is the anyOf of their structures; a member the schema's
    `type` refuses is no branch (`[` under type object and an enum holding [1] began an
    array no end could take)."""
    _assert_offered(cfg, tokenizer, schema, "", refused, allowed)


@pytest.mark.parametrize("schema", [{"prefixItems": [True, False]}, {"prefixItems": [True, {"not": {}}]},
                                    {"type": "array", "prefixItems": [{"type": "integer"}], "items": {"enum": []}}])
def test_no_comma_before_an_item_no_value_can_be(cfg, tokenizer, schema):
    """A comma is refused where the next item's rule admits no value (`false`, `not {}`):
    `[1,` under prefixItems [true, false] was a dead end."""
    g = _grammar(cfg, schema).copy()
    for t in tokenizer.encode("[1", add_special_tokens=False):
        g.accept_token(t)
    row = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    g.fill_mask(row)
    assert not row[tokenizer.encode(",", add_special_tokens=False)[0]]
    assert row[tokenizer.encode("]", add_special_tokens=False)[0]]


@pytest.mark.parametrize("bounds,kind", _BOUNDS + [({"minimum": 0, "maximum": 99}, "integer"),
                                                   ({"minimum": -127, "maximum": 128}, ""),
                                                   ({"minimum": 60}, "integer")])
@pytest.mark.parametrize("number", ["integer", "number"])
def test_bounded_number_texts_of_one_class_have_one_future(bounds, kind, number):
    """canonical._number_class against brute force: texts (sign, digits, fraction) of up to
    three characters that it gives one representative are accepted alike after every
    continuation of up to three digits or a point, and complete alike (the exponent is
    stepped from the concrete state: canonical.class_exponent)."""
    import itertools

    from lmprog_runtime.constrained.cfg.backend import compile_machine
    from lmprog_runtime.constrained.cfg.canonical import _number_class
    machine = compile_machine("json", json.dumps(dict(bounds, type=kind or number)), "")

    def after(text: str):
        state = machine.initial()
        for k, b in enumerate(text.encode()):
            state = machine.advance(state, b, k, None)
            if not state:
                return None
        return state

    def future(state, pos: int, depth: int = 3) -> tuple:
        """Acceptance at `state`, then each continuation's (a dead one's ends there)."""
        if not state:
            return ()
        out = [machine.accepting(state, pos, None)]
        if depth:
            for b in b"0123456789.":
                out.append(future(machine.advance(state, b, pos, None), pos + 1, depth - 1))
        return tuple(out)

    classes: dict = {}
    for p in (p for n in range(1, 4) for p in map("".join, itertools.product("0123456789.-", repeat=n))):
        state = after(p)
        if state is None or len(state) != 1 or state[0][0][0] != "N":
            continue
        rep = _number_class(state[0][0], exponent_free=True)
        if rep is not None:
            classes.setdefault((state[0][0][3], rep), []).append(p)
    if bounds == {"minimum": 0, "maximum": 99}:  # (texts do share: 1-9, 10-99 ...)
        assert max(map(len, classes.values())) >= 90, classes
    for texts in classes.values():
        first = future(after(texts[0]), len(texts[0]))
        for p in texts[1:5] + texts[-4:]:
            assert future(after(p), len(p)) == first, (bounds, kind or number, texts[0], p)


# kinds no value can be, by the rule's own keywords (schema.py _drop_impossible_kinds): the
# root mask is empty (the scheduler fails such a request with a 400 at its first step)
_IMPOSSIBLE = [
    {"type": "object", "required": ["a"], "properties": {"a": False}},
    {"type": "object", "required": ["a"], "additionalProperties": False},
    {"type": "object", "required": ["a"], "properties": {"a": {"type": "string", "minLength": 3, "maxLength": 2}}},
    {"type": "object", "required": ["ab"], "patternProperties": {"b": {"not": {}}}},
    {"type": "object", "required": ["abcd"], "propertyNames": {"maxLength": 3}},
    {"type": "object", "required": ["a"], "propertyNames": {"enum": ["b"]}},
    {"type": "object", "required": ["a"], "propertyNames": False},
    {"type": "object", "minProperties": 2, "maxProperties": 1},
    {"type": "object", "required": ["a", "b"], "maxProperties": 1},
    {"type": "object", "required": ["a"], "dependentRequired": {"a": ["b"], "b": ["c"]}, "maxProperties": 2},
    {"type": "object", "required": ["a"], "dependentRequired": {"a": ["b", "c"]}, "propertyNames": {"enum": ["a", "b"]}},
    {"$schema": "http://json-schema.org/draft-04/schema#", "type": "string", "not": {"type": "string"}},
    {"type": "object", "properties": {"a": True, "b": False}, "additionalProperties": False, "minProperties": 2},
    {"type": "array", "minItems": 1, "items": False},
    {"type": "array", "prefixItems": [{"type": "integer"}, False], "minItems": 2},
    {"type": "array", "minItems": 2, "maxItems": 1},
    {"type": "string", "minLength": 3, "maxLength": 2},
    {"type": "string", "enum": ["a", "bb"], "minLength": 3},
    {"type": "string", "enum": ["abc", "x1"], "pattern": "^[0-9]+$"},
    {"type": "string", "pattern": "^\\d{3}-\\d{4}$", "maxLength": 7},  # (patterns' shortest match past maxLength)
    {"type": "object", "required": ["a"], "properties": {"a": {"type": "string", "pattern": "(foo|barbaz)$",
                                                              "maxLength": 2}}},
    {"type": "integer", "minimum": 1.2, "maximum": 1.8},
    {"type": "number", "exclusiveMinimum": 5, "maximum": 5},
    {"type": "number", "multipleOf": 5, "minimum": 1, "maximum": 4},
    {"type": "integer", "multipleOf": 3, "exclusiveMinimum": 3, "exclusiveMaximum": 6},
    {"enum": [1, 2], "minimum": 3},
    {"type": "object", "properties": {"x": {"type": "array", "minItems": 3, "maxItems": 2}}, "required": ["x"]},
    # enum / const members the keywords beside them refuse (schema._valid_members)
    {"const": {"a": False}, "patternProperties": {"^a": {"type": "integer"}}},
    {"enum": [[True], [2]], "contains": {"const": 1}},
    {"enum": ["ab", "abc"], "not": {"pattern": "b"}},
    {"const": {"foo": "bar"}, "unevaluatedProperties": False},
    # a conditional with a `false` branch (schema._conditional_as_all_of)
    {"type": "object", "if": {"const": 1}, "else": False},
    {"type": "string", "if": {"type": "string"}, "then": False},
    # two branches of a oneOf every value meets
    {"oneOf": [True, {}, {"type": "string"}]},
    {"oneOf": [True, True], "anyOf": [{"maxLength": 2}, {"type": "number"}]},
    {"oneOf": [{"maxLength": 3}, {"minimum": 3}, {"required": ["a"]}]},  # (each kind: two branches take all of it)
    {"type": "string", "anyOf": [{"type": "number"}, {"type": "null"}]},  # (no branch of the string's type)
]


@pytest.mark.parametrize("schema", _IMPOSSIBLE)
def test_a_rule_no_value_meets_begins_no_value(cfg, tokenizer, schema):
    """A kind whose own keywords no value of it meets is no kind of the rule (each was
    begun, then nothing could complete it: `{` under a required member that no value can be
    took keys forever), and an object that requires such a member, or an array whose first
    items must be such values, is no value either (the parent's kind goes too)."""
    row = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    _grammar(cfg, schema).copy().fill_mask(row)
    assert not row.any(), schema


@pytest.mark.parametrize("schema,value", [
    ({"type": "object", "required": ["a"], "properties": {"a": {"minimum": 3, "maximum": 2}}}, {"a": "x"}),
    ({"type": ["string", "integer"], "minLength": 3, "maxLength": 2}, 7),
    ({"type": "object", "required": ["a"], "patternProperties": {"^a$": {"type": "integer"}},
      "additionalProperties": False}, {"a": 1}),
    ({"type": "object", "required": ["ab"], "propertyNames": {"maxLength": 3, "pattern": "b"}}, {"ab": None}),
    ({"type": "array", "prefixItems": [{"type": "integer"}, False]}, [1]),
    ({"type": "array", "minItems": 1, "prefixItems": [True], "items": False}, [[]]),
    ({"type": "number", "minimum": 1.2, "maximum": 1.8}, 1.5),
    ({"type": "number", "multipleOf": 0.7, "minimum": 1, "maximum": 1.5}, 1.4),
    ({"type": "integer", "multipleOf": 0.5, "minimum": 1, "maximum": 1.5}, 1),
    ({"type": "string", "enum": ["a", "bbb"], "minLength": 2}, "bbb"),
    ({"enum": [1, 2, {"b": 1}, {"a": "x"}], "minimum": 2, "patternProperties": {"^a": {"type": "integer"}}}, 2),
    ({"enum": [1, 2, {"b": 1}, {"a": "x"}], "minimum": 2, "patternProperties": {"^a": {"type": "integer"}}}, {"b": 1}),
    ({"if": {"type": "string"}, "then": {"minLength": 2}, "else": False}, "ab"),
    ({"if": {"type": "string"}, "then": False, "else": {"minimum": 3}}, 4),
    ({"type": "object", "if": {"properties": {"a": {"const": 1}}}, "else": False, "unevaluatedProperties": False},
     {"a": 1}),
    ({"oneOf": [True, {"type": "string"}]}, 1),
    ({"enum": [{"foo": 1}, {"bar": 1}], "properties": {"foo": True}, "unevaluatedProperties": False}, {"foo": 1}),
])
def test_what_those_keywords_leave_possible_stays(cfg, tokenizer, schema, value):
    """Only the impossible kinds go: the value (valid by jsonschema) is still accepted."""
    assert jsonschema.validators.validator_for(schema)(schema).is_valid(value)
    assert _accepts(cfg, tokenizer, schema, json.dumps(value, separators=(",", ":"))), (schema, value)


def test_a_string_enum_is_narrowed_to_the_members_its_rule_takes(cfg, tokenizer):
    """`"a` under enum ["a", "bbb"] and minLength 2 was a string no quote could close."""
    _assert_offered(cfg, tokenizer, {"type": "string", "enum": ["a", "bbb"], "minLength": 2}, '"', ["a"], ["b"])


def test_a_member_whose_value_is_impossible_is_refused_in_a_parent(cfg, tokenizer):
    schema = {"type": "object", "properties": {"x": {"type": "object", "required": ["a"], "properties": {"a": False}},
                                               "y": {"type": "integer"}}}
    assert not _accepts(cfg, tokenizer, schema, '{"x":{"a":1}}')
    assert _accepts(cfg, tokenizer, schema, '{"y":1}')
    _assert_offered(cfg, tokenizer, schema, '{"x', ['":', '"'], [])


@pytest.mark.parametrize("schema,valid,invalid", [
    ({"enum": [1, 2, {"b": 1}, {"a": "x"}], "minimum": 2, "patternProperties": {"^a": {"type": "integer"}}},
     ["2", '{"b":1}'], ["1", '{"a":"x"}']),
    ({"if": {"type": "string"}, "then": {"minLength": 2}, "else": False}, ['"ab"'], ['"a"', "1", "{}"]),
    ({"if": {"type": "string"}, "then": False, "else": {"minimum": 3}}, ["4", "{}"], ['"a"', "2"]),
])
def test_members_and_branches_the_schema_refuses_are_not_begun(cfg, tokenizer, schema, valid, invalid):
    """An enum's members that the keywords beside them refuse are no members (validated at
    compile), and an if / then / else with a `false` branch is the allOf it means: before,
    `{"a":"x"}` was begun under the enum and refused at its end, `{` taken under `else:
    false` and never completed. Agrees with jsonschema either way."""
    validator = jsonschema.validators.validator_for(schema)(schema)
    for text in valid + invalid:
        assert validator.is_valid(json.loads(text)) == (text in valid), text
        assert _accepts(cfg, tokenizer, schema, text) == (text in valid), (schema, text)
    if "enum" in schema:
        _assert_offered(cfg, tokenizer, schema, '{"', ["a"], ["b"])
    else:
        _assert_offered(cfg, tokenizer, schema, "", ["{"] if schema.get("else") is False else ['"'], [])


def test_not_pattern_beside_other_kinds_keywords_is_a_string_without_a_match(cfg, tokenizer):
    """`not {pattern: P}` refuses every value but a string without a match of P, so keywords
    of other kinds beside it read nothing: `"ab` under `{"maxItems": 2, "not": {"pattern":
    "b"}}` was a string no quote could close, `[` an array nothing could complete."""
    schema = {"maxItems": 2, "minLength": 2, "not": {"pattern": "b"}}
    _assert_offered(cfg, tokenizer, schema, "", ["[", "{", "1", "t"], ['"'])
    _assert_offered(cfg, tokenizer, schema, '"a', ["b", "bb"], ["a", "c"])
    validator = jsonschema.validators.validator_for(schema)(schema)
    for text in ['"aa"', '"a"', '"ab"', "[1]", "3"]:
        assert _accepts(cfg, tokenizer, schema, text) == validator.is_valid(json.loads(text)), text


@pytest.mark.parametrize("schema,refused,allowed", [
    ({"if": True, "then": {"const": "then"}, "else": {"const": "else"}}, ["e", "el"], ["t", "th"]),
    ({"if": {}, "then": {"const": "then"}, "else": {"const": "else"}}, ["e", "el"], ["t", "th"]),
    ({"if": False, "then": {"const": "then"}, "else": {"const": "else"}}, ["t", "th"], ["e", "el"]),
])
def test_an_if_every_value_or_none_meets_is_its_branch(cfg, tokenizer, schema, refused, allowed):
    """`if: true` is its `then`, `if: false` its `else`: before, both branches were a check
    at the string's end, so `"else` was begun under `if: true` and refused at its quote."""
    _assert_offered(cfg, tokenizer, schema, '"', refused, allowed)
    validator = jsonschema.validators.validator_for(schema)(schema)
    for text in ['"then"', '"else"', "1"]:
        assert _accepts(cfg, tokenizer, schema, text) == validator.is_valid(json.loads(text)), text


_CROWDED = {"type": "object", "maxProperties": 2, "required": ["zz"]}
_DEPENDENT = {"type": "object", "maxProperties": 2, "dependentRequired": {"a": ["b", "c"], "d": ["e"]}}


@pytest.mark.parametrize("schema,prefix,refused,allowed", [
    (_CROWDED, '{"', [], ["a", "b", "z", "zz"]),  # (room for one other key)
    (_CROWDED, '{"a":1,"', ["a", "b"], ["z", "zz"]),  # (the room left is the required key's)
    ({**_CROWDED, "properties": {"a": {"type": "integer"}}}, '{"a":1,"', ["a", "b"], ["z", "zz"]),
    ({**_CROWDED, "maxProperties": 1}, '{"', ["a", "b"], ["z", "zz"]),
    (_DEPENDENT, '{"a', ['"', '":'], ["b"]),  # (`a` brings two more keys: three in all)
    (_DEPENDENT, '{"d', [], ['"', '":']),  # (`d` and `e` fit)
    (_DEPENDENT, '{"x":1,"d', ['"', '":'], ["e"]),  # (after `x`, `d` leaves no room for `e`)
    (_DEPENDENT, '{"d":1,"', ["a", "d", "x"], ["e"]),
    ({"type": "object", "propertyNames": {"enum": ["a", "b"]}}, '{"a":1,"b":2', [","], ["}"]),  # (no name left)
])
def test_keys_leave_room_for_those_still_required(cfg, tokenizer, schema, prefix, refused, allowed):
    """Under maxProperties, a key is taken only where the keys it leaves still required
    (required, dependentRequired, theirs in turn) fit in the room left: once only they fit,
    the next key is one of them. Before, `{"a":1,"b":2` was taken under maxProperties 2
    and required `zz`, and nothing could follow it."""
    _assert_offered(cfg, tokenizer, schema, prefix, refused, allowed)


@pytest.mark.parametrize("schema,texts", [
    (_CROWDED, ['{"zz":1}', '{"a":1,"zz":2}', '{"zz":1,"a":[]}', '{"a":1,"b":2}', '{"a":1}']),
    (_DEPENDENT, ['{"d":1,"e":2}', '{"x":1,"y":2}', '{"a":1,"b":2}', '{"e":1,"d":2}', '{"x":1,"d":2}']),
])
def test_what_leaves_room_is_taken(cfg, tokenizer, schema, texts):
    validator = jsonschema.validators.validator_for(schema)(schema)
    for text in texts:
        assert _accepts(cfg, tokenizer, schema, text) == validator.is_valid(json.loads(text)), text


@pytest.mark.parametrize("schema,texts", [
    ({"const": 2, "minimum": 0.5}, ["2", "0.2e1", "20e-1", "2e0", "0.2", "0.5"]),
    ({"enum": [1, 5, 10], "minimum": 3}, ["5", "10", "1.0e1", "0.5e1", "1", "0.1e1", "3"]),
    ({"enum": [0.25, 7], "maximum": 1, "multipleOf": 0.05}, ["0.25", "2.5e-1", "25e-2", "7", "0.7e1"]),
])
def test_an_enum_under_bounds_is_its_members_within_them(cfg, tokenizer, schema, texts):
    """A numeric enum beside bounds is the members within them, each in every spelling
    (the mantissa alone is not held to the bounds: `0.2e1` is 2). Before, both checks read
    every prefix apart: `0` was taken under `const: 2, minimum: 0.5` (for `0.2e1`, then
    refused at its `2`, below the minimum) and nothing followed it."""
    validator = jsonschema.validators.validator_for(schema)(schema)
    for text in texts:
        assert _accepts(cfg, tokenizer, schema, text) == validator.is_valid(json.loads(text)), text
    _assert_offered(cfg, tokenizer, {"const": 2, "minimum": 0.5}, "0.", ["5", "9"], ["2"])


_TWO_REQUIRED = {"properties": {"foo": {"type": "string"}},
                 "oneOf": [{"properties": {"bar": {"const": "bar"}}, "required": ["bar"]},
                           {"properties": {"baz": {"const": "baz"}}, "required": ["baz"]}]}


@pytest.mark.parametrize("schema,refused,allowed,texts", [
    (_TWO_REQUIRED, ['"', "1", "["], ["{"], ['"a"', "1", '{"bar":"bar"}', '{"bar":"bar","baz":"baz"}', "{}"]),
    ({"oneOf": [{"type": "string"}, {"minimum": 3}]}, ['"'], ["4", "["], ['"a"', "4", "2", "[]", "null"]),
    ({"type": ["string", "integer"], "oneOf": [{"type": "boolean"}, {"minimum": 1}]}, ["t"], ['"', "1"],
     ['"a"', "1", "0", "true"]),
])
def test_kinds_two_one_of_branches_take_whole_are_no_value(cfg, tokenizer, schema, refused, allowed, texts):
    """A value of a kind that two oneOf branches take every value of meets both, so not
    exactly one: that kind is no value of the rule (`"` was begun under two branches that
    each require a member, which a string passes, and refused at the string's end); a
    branch none of whose types the rest allows is no branch."""
    _assert_offered(cfg, tokenizer, schema, "", refused, allowed)
    validator = jsonschema.validators.validator_for(schema)(schema)
    for text in texts:
        assert _accepts(cfg, tokenizer, schema, text) == validator.is_valid(json.loads(text)), text


_NOT_B = {"pattern": "b"}


@pytest.mark.parametrize("schema,refused,allowed,texts", [
    ({"$defs": {"A": {"unevaluatedProperties": False}}, "$ref": "#/$defs/A",
      "properties": {"p": {"type": "string"}}, "not": _NOT_B}, ["{", "[", "1", "null"], ['"'],
     ['"a"', '"ab"', "{}", "1"]),
    ({"allOf": [{"properties": {"foo": True}, "unevaluatedProperties": False}],
      "anyOf": [{"properties": {"bar": True}, "const": "abc"}]}, ["{", "[", "1"], ['"'], ['"abc"', '"ab"', "{}"]),
    ({"properties": {"a": {"type": "integer"}}, "anyOf": [{"type": "array"}, {"maxItems": 2, "not": {}}]},
     ["{", '"', "1"], ["["], ["[]", '{"a":1}', "[1,2,3]"]),
])
def test_kinds_a_not_or_a_choice_leaves_no_value_of_are_not_begun(cfg, tokenizer, schema, refused, allowed, texts):
    """A value of a kind that the `not` takes every value of (`{pattern: P}` passes every
    non-string), or that no anyOf branch has a value of, is never valid: its first byte is
    refused, beside a reference or keywords of other kinds too (`{` was begun under
    `not {pattern: b}` and then nothing could close the object)."""
    _assert_offered(cfg, tokenizer, schema, "", refused, allowed)
    validator = jsonschema.validators.validator_for(schema)(schema)
    for text in texts:
        assert _accepts(cfg, tokenizer, schema, text) == validator.is_valid(json.loads(text)), text


@pytest.mark.parametrize("prefix,refused,allowed", [('{"bar":', ["1", "-", "{"], ['"']),
                                                    ('{"bar":"bar","', ["baz"], ["foo"])])
def test_a_one_of_branch_bounds_the_members_it_leaves_unevaluated(cfg, tokenizer, prefix, refused, allowed):
    """Under oneOf and unevaluatedProperties, a member that only one branch declares is
    evaluated only where that branch passes, so it holds to that branch: `bar` here is
    `"bar"` or nothing (`{"bar":1` was taken, and then no object could end)."""
    schema = {**_TWO_REQUIRED, "unevaluatedProperties": False}
    _assert_offered(cfg, tokenizer, schema, prefix, refused, allowed)
    validator = jsonschema.validators.validator_for(schema)(schema)
    for text in ['{"bar":"bar"}', '{"baz":"baz","foo":"x"}', '{"bar":"bar","baz":"baz"}', '{"bar":1,"baz":"baz"}',
                 '{"foo":"x"}', '{"bar":"bar","foo":"x"}']:
        assert _accepts(cfg, tokenizer, schema, text) == validator.is_valid(json.loads(text)), text


@pytest.mark.parametrize("schema", [
    {"properties": {"foo": {"type": "integer"}}, "additionalProperties": False,
     "anyOf": [{"properties": {"bar": True}, "required": ["bar"]}, {"required": ["foo"]}]},
    {"allOf": [{"properties": {"foo": {"type": "integer"}}, "unevaluatedProperties": False}],
     "anyOf": [{"properties": {"bar": True}, "required": ["bar"]}, {"required": ["foo"]}]},
])
def test_a_branch_is_held_to_the_closed_object_beside_it(cfg, tokenizer, schema):
    """A choice's branch that does not merge exactly with the closed object beside it
    (additionalProperties there, properties in the branch) is still held to it: `bar`, which
    only the branch declares, is no member, so that branch is no value (`{"bar"` was taken
    under the branch's own structure, then the object refused at its end); an allOf part's
    unevaluatedProperties with nothing in place beside it is that part's
    additionalProperties."""
    _assert_offered(cfg, tokenizer, schema, '{"', ["bar"], ["foo"])
    validator = jsonschema.validators.validator_for(schema)(schema)
    for text in ['{"foo":1}', '{"bar":1}', '{"foo":1,"bar":2}', "{}", '"x"']:
        assert _accepts(cfg, tokenizer, schema, text) == validator.is_valid(json.loads(text)), text


def test_an_all_of_part_closed_by_unevaluated_properties_merges_with_the_rest(cfg, tokenizer):
    """An allOf part whose unevaluatedProperties has nothing applied in place beside it is that
    part's additionalProperties, so the parts merge: here the oneOf requires `a` or `b`, which
    the closed part refuses, and a value of any other kind meets both branches: no value at
    all, and no first byte (`{"foo":` was begun, and nothing could end the object)."""
    schema = {"allOf": [{"properties": {"foo": True}, "unevaluatedProperties": False}],
              "anyOf": [{"properties": {"bar": True}}], "oneOf": [{"required": ["a"]}, {"required": ["b"]}]}
    _assert_offered(cfg, tokenizer, schema, "", ["{", '"', "1", "[", "null"], [])
    validator = jsonschema.validators.validator_for(schema)(schema)
    assert not any(validator.is_valid(v) for v in ({}, {"foo": 1}, {"a": 1}, {"foo": 1, "a": 1}, "x", 1, None))


@pytest.mark.parametrize("schema,texts", [
    ({"allOf": [{"enum": [1, 2, "a"]}, {"enum": [1.0, "a", True]}]}, ["1", "1.0", "2", '"a"', "true"]),
    ({"allOf": [{"const": True}, {"const": 1}]}, ["true", "1"]),
    ({"allOf": [{"enum": [[1], {"a": 2}]}, {"enum": [[1.0], {"a": 2.0}, [True]]}]}, ["[1]", '{"a":2}', "[true]"]),
])
def test_all_of_members_compare_as_json_schema_does(cfg, tokenizer, schema, texts):
    """Merged enums and constants compare as JSON Schema does: 1 and 1.0 are one number, and
    `true` is not 1 (Python's == said both the other way round: the enum's intersection
    dropped 1.0, and `const: true` beside `const: 1` took `true`, which neither keeps)."""
    validator = jsonschema.validators.validator_for(schema)(schema)
    for text in texts:
        assert _accepts(cfg, tokenizer, schema, text) == validator.is_valid(json.loads(text)), text


_D4 = "http://json-schema.org/draft-04/schema#"


@pytest.mark.parametrize("schema,prefix,refused,allowed,texts", [
    ({"type": "string", "maxLength": 4, "pattern": "b"}, '"xyz', ["a", "é", '"'], ["b"],
     ['"xyzb"', '"xyza"', '"bbbb"', '"abcde"']),
    ({"type": "string", "maxLength": 4, "pattern": "b"}, '"xy', ['"'], ["a", "ab", "ba", "b"], ['"xyab"']),
    ({"type": "string", "maxLength": 6, "pattern": "^[a-z]+@[a-z]+$"}, '"abc', ["de"], ["@", "d"],
     ['"abc@d"', '"abcd@e"', '"abcde@f"']),
    ({"type": "object", "propertyNames": {"maxLength": 3, "pattern": "k"}}, '{"ab', ["c"], ["k"],
     ['{"abk":1}', '{"abc":1}']),
])
def test_patterns_keep_their_room_under_max_length(cfg, tokenizer, schema, prefix, refused, allowed, texts):
    """Under maxLength a string's patterns must still be able to match within the characters
    left: a character (a token) after which one needs more than are left is refused there,
    not at the closing quote that could then never come (`{"maxLength": 4, "pattern": "b"}`
    took `"xyza`, and a sampled decode met an empty mask)."""
    _assert_offered(cfg, tokenizer, schema, prefix, refused, allowed)
    validator = jsonschema.validators.validator_for(schema)(schema)
    for text in texts:
        assert _accepts(cfg, tokenizer, schema, text) == validator.is_valid(json.loads(text)), text


@pytest.mark.parametrize("schema,prefix,refused,allowed", [
    ({"$schema": _D4, "enum": [{"a": 1}]}, '{"a":0', [" ", "}"], ["."]),
    ({"$schema": _D4, "type": "object", "properties": {"m": {"type": "string"}}, "enum": [1, None, [1], {"a": 1}]},
     '{"a":', ["2"], ["1"]),
    ({"$schema": _D4, "enum": [[1, "x"]]}, "[1,", ["1", "t"], ['"']),
])
def test_constant_structures_hold_in_draft_04(cfg, tokenizer, schema, prefix, refused, allowed):
    """An enum's objects and arrays are their literal structure in every dialect: the
    structure's scalars were `const`, which draft-04 does not have (its validator, the
    residual's, ignores it), so `{"a":0 ` was taken under `enum: [{"a": 1}]` and refused only
    at its end."""
    _assert_offered(cfg, tokenizer, schema, prefix, refused, allowed)
    validator = jsonschema.validators.validator_for(schema)(schema)
    for text in ('{"a":1}', '{"a":0}', "[1,\"x\"]", "[1,1]"):
        assert _accepts(cfg, tokenizer, schema, text) == validator.is_valid(json.loads(text)), text


def test_enum_members_beside_references_are_validated(cfg, tokenizer):
    """An enum beside keywords holding a `$ref` keeps only the members valid under them (the
    residual's validator resolves the reference where the schema is the document's own):
    `bars`' one array member has an item its `$ref`'d rule refuses, so `bars` has no value
    and its key is refused, where before `"bars":[` was taken and nothing after it."""
    schema = {"$schema": _D4, "definitions": {"t": {"type": "string"}}, "type": "object",
              "properties": {"bars": {"type": "array", "items": {"allOf": [{"$ref": "#/definitions/t"}]},
                                      "enum": [1, "a", None, [1], [2, "b"]]}}}
    _assert_offered(cfg, tokenizer, schema, '{"bars', ['":'], [])
    schema["properties"]["bars"]["enum"].append(["x"])
    assert _accepts(cfg, tokenizer, schema, '{"bars":["x"]}')
    assert not _accepts(cfg, tokenizer, schema, '{"bars":[1]}')


@pytest.mark.parametrize("text,ok", [
    ('"xyz\xcf'.encode("latin-1"), False), ('"xyzé'.encode(), False), (b'"xyz\\', True), (b'"xyz\\u006', True),
    (b'"xyz\\u0061', False), (b'"xyz\\u0062"', True), ('"xyπb"'.encode(), True), ('"xyzπ'.encode(), False),
])
def test_a_characters_first_bytes_leave_its_patterns_room(text, ok):
    """A character is refused at its first byte (a UTF-8 lead byte, `\\`, a `\\u` digit)
    where none it may be leaves the patterns room under maxLength (RegexPool.first_within):
    a token ending inside a character is no dead end either."""
    from lmprog_runtime.constrained.cfg.backend import compile_machine
    m = compile_machine("json", json.dumps({"type": "string", "maxLength": 4, "pattern": "b"}))
    state = m.initial()
    for i, b in enumerate(text):
        state = m.advance(state, b, i, lambda s, e: text[s:e])
        if not state:
            break
    assert bool(state) == ok, text


@pytest.mark.parametrize("pattern", ["b", "^[a-z]+@[a-z]+$", "(foo|barbaz)$", "^\\p{L}+é$"])
def test_sampled_strings_under_a_pattern_and_max_length_end_and_agree(cfg, tokenizer, pattern):
    """Sampled decodes (short tokens first, to meet maxLength) of strings under a pattern and
    maxLength: the mask is never empty before the value ends, the matcher takes each sampled
    token, and the C walk's masks equal the Python walk's (the oracle)."""
    import random
    import numpy as np
    rng = random.Random(5)
    oracle = create_grammar_backend("cfg", tokenizer, vocab_size=49152 + 64, eos_token_ids=[tokenizer.eos_token_id])
    short = np.array([0 < len(tokenizer.convert_ids_to_tokens(t) or "") <= 2 for t in range(49152 + 64)])
    try:
        for max_len in (3, 7):
            schema = {"type": "array", "items": {"type": "string", "pattern": pattern, "maxLength": max_len}}
            a, b = _grammar(cfg, schema).copy(), _grammar(oracle, schema).copy()
            b._shared.engine.use_c = False
            wa, wb = np.zeros(1538, dtype=np.int32), np.zeros(1538, dtype=np.int32)
            for _ in range(30):
                a.write_bitmask(wa)
                b.write_bitmask(wb)
                assert np.array_equal(wa, wb), (pattern, max_len, bytes(a._hist))
                bits = np.unpackbits(wa.view(np.uint8), bitorder="little").astype(bool)
                assert bits.any(), ("dead end", pattern, max_len, bytes(a._hist))
                pool = np.nonzero(bits & short)[0] if (bits & short).any() else np.nonzero(bits)[0]
                t = int(rng.choice(list(pool)))
                if t == tokenizer.eos_token_id:
                    break
                a.accept_token(t)
                b.accept_token(t)
    finally:
        oracle.shutdown()
