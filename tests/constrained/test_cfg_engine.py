"""The cfg grammar engine at token level (real SmolLM2 tokenizer): every instance is
walked token by token through fill_mask / accept_token and must end with EOS allowed
exactly when the instance is valid."""
import json
import random
import re
import time

import jsonschema
import pytest
import torch

from lmprog_runtime.constrained import GrammarError, create_grammar_backend


@pytest.fixture(scope="module")
def cfg(tokenizer):
    be = create_grammar_backend("cfg", tokenizer, vocab_size=49152 + 64, eos_token_ids=[tokenizer.eos_token_id])
    yield be
    be.shutdown()


def compile_(be, schema, kind="json"):
    return be.get_future(kind, schema if isinstance(schema, str) else json.dumps(schema)).result(timeout=60)


def accepts(be, tokenizer, schema, text, kind="json") -> bool:
    g = compile_(be, schema, kind)
    row = torch.zeros(be.vocab_size, dtype=torch.bool)
    for t in tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]:
        row.numpy().fill(False)
        g.fill_mask(row)
        if not row[t]:
            return False  # the mask may look one byte further than accept_token
        try:
            g.accept_token(t)
        except GrammarError:
            assert not row[t], f"mask allows token {t} that accept_token refuses"
            return False
        assert row[t], f"accept_token took token {t} that the mask refuses"
    return True


def check(be, tokenizer, schema, valid, invalid):
    for v in valid:
        for text in (json.dumps(v, ensure_ascii=False), json.dumps(v, separators=(",", ":"))):
            assert accepts(be, tokenizer, schema, text), f"valid instance refused: {text}"
    for v in invalid:
        text = json.dumps(v)
        assert not accepts(be, tokenizer, schema, text), f"invalid instance accepted: {text}"


PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


def test_keys_in_any_order_and_required_by_state(cfg, tokenizer):
    check(cfg, tokenizer, PERSON, [{"name": "a", "age": 1}, {"age": 1, "name": "a"}],
          [{"name": "a"}, {"age": 1}, {}])
    assert not accepts(cfg, tokenizer, PERSON, '{"name": "a", "name": "b", "age": 1}')  # duplicate key


def test_open_objects_by_default_closed_when_asked(cfg, tokenizer):
    check(cfg, tokenizer, PERSON, [{"name": "a", "age": 1, "extra": {"deep": [1, {"x": None}]}}], [])
    closed = dict(PERSON, additionalProperties=False)
    check(cfg, tokenizer, closed, [{"name": "a", "age": 1}], [{"name": "a", "age": 1, "extra": 1}])
    typed = dict(PERSON, additionalProperties={"type": "number"})
    check(cfg, tokenizer, typed, [{"name": "a", "age": 1, "x": 2.5}], [{"name": "a", "age": 1, "x": "s"}])


def test_recursion_has_no_depth_bound(cfg, tokenizer):
    tree = {"$defs": {"t": {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/t"}}},
                            "additionalProperties": False}}, "$ref": "#/$defs/t"}
    deep: dict = {"kids": []}
    for _ in range(12):
        deep = {"kids": [deep]}
    check(cfg, tokenizer, tree, [deep], [{"kids": [{"kid": []}]}])
    free = {"type": "object"}
    nested: list = [1]
    for _ in range(20):
        nested = [nested]
    check(cfg, tokenizer, free, [{"a": nested}], [])


def test_nesting_is_bounded_like_a_json_parsers(cfg, tokenizer):
    """MAX_NESTING arrays and objects open at once, no more: deeper, a mask would cost more
    per level and the state's tuples compare past Python's recursion limit (a request
    failed with RecursionError near 1,000 levels)."""
    from lmprog_runtime.constrained.cfg.machine import MAX_NESTING
    n = MAX_NESTING
    for schema in ({}, {"type": "array", "items": {"$ref": "#"}}):
        assert accepts(cfg, tokenizer, schema, "[" * n + "]" * n)
        assert not accepts(cfg, tokenizer, schema, "[" * (n + 1) + "]" * (n + 1))
    assert accepts(cfg, tokenizer, {}, '{"a":' * (n - 1) + "[1]" + "}" * (n - 1))
    assert not accepts(cfg, tokenizer, {}, '{"a":' * n + "[1]" + "}" * n)
    assert accepts(cfg, tokenizer, {}, '{"a":' * n + "1" + "}" * n)


def test_large_max_length_compiles_in_milliseconds(cfg, tokenizer):
    schema = {"type": "string", "maxLength": 100000, "minLength": 3}
    t0 = time.perf_counter()
    compile_(cfg, schema)
    assert time.perf_counter() - t0 < 2.0
    check(cfg, tokenizer, schema, ["abc", "x" * 500], ["ab"])
    small = {"type": "string", "maxLength": 5}
    check(cfg, tokenizer, small, ["hello", "中文字"], ["hello!"])


def test_patterns_formats_and_unicode_properties(cfg, tokenizer):
    check(cfg, tokenizer, {"type": "string", "pattern": "^[A-Z]{2}-\\d{3}$"}, ["AB-123"], ["AB-12", "ab-123"])
    check(cfg, tokenizer, {"type": "string", "pattern": "\\p{Lu}"}, ["xYz"], ["xyz"])
    check(cfg, tokenizer, {"type": "string", "format": "date"}, ["2024-02-29", "2000-02-29", "2023-04-30", "2023-12-31"],
          ["2024-13-01", "x", "2023-02-29", "1900-02-29", "2023-04-31", "2023-02-30"])  # (each month's days)
    check(cfg, tokenizer, {"type": "string", "format": "date-time"}, ["2024-02-29T00:00:00Z"], ["2023-02-29T00:00:00Z"])
    check(cfg, tokenizer, {"type": "string", "format": "uuid"}, ["123e4567-e89b-12d3-a456-426614174000"], ["123"])
    check(cfg, tokenizer, {"type": "string", "format": "ipv4"}, ["10.0.0.255"], ["10.0.0.256"])
    check(cfg, tokenizer, {"type": "string", "format": "date-time"}, ["2024-02-29T12:30:00Z"],
          ["2024-02-29 12:30"])
    with pytest.raises(GrammarError, match="lookaround"):
        compile_(cfg, {"type": "string", "pattern": "(?=a)b"})


def test_a_search_pattern_is_one_state_past_its_match():
    """`pattern` searches (`f.*` is `[^]*f.*[^]*`): once matched, whatever follows, the
    pattern's state is one (Σ* absorbs what it is joined with), so keys and strings matched
    by it share their states and masks; the languages are unchanged."""
    from lmprog_runtime.constrained.cfg.regex import RegexPool
    from lmprog_runtime.constrained.cfg.regex_parse import compile_pattern
    pool = RegexPool()
    after = {}
    for pattern in ("f.*", "f", "^f", "(a|f)o*", "x+f"):
        term = compile_pattern(pool, pattern, True)
        for text in ("f", "foo", "xfoo", "afof", "ff\n", "x"):
            state = term
            for ch in text:
                state = pool.step(state, ord(ch))
            after[pattern, text] = state
            assert pool.nullable(state) == bool(re.search(pattern, text)), (pattern, text)
    assert after["f.*", "f"] == after["f.*", "foo"] == after["f.*", "xfoo"] == after["f", "afof"] == pool.any_star()
    assert after["^f", "foo"] == after["^f", "ff\n"] == pool.any_star() != after["x+f", "x"]


def test_a_complement_pattern_is_dead_from_the_match_on():
    """`not {pattern: P}`'s strings: P's search term complemented (RegexPool.complement), a
    state that dies at the character completing a match (its pattern's state there is Σ*)."""
    from lmprog_runtime.constrained.cfg.regex import RegexPool
    from lmprog_runtime.constrained.cfg.regex_parse import compile_pattern
    pool = RegexPool()
    for pattern in ("a+b", "^x", "\\d$", "b|c{2}"):
        term = compile_pattern(pool, pattern, True)
        comp = pool.complement(term)
        assert pool.complement(comp) == term
        for text in ("", "xa", "aab", "ba", "xaabz", "x1", "1x", "cc", "acb"):
            assert pool.accepts(comp, text) == (re.search(pattern, text) is None), (pattern, text)
    state = pool.complement(compile_pattern(pool, "a+b", True))
    for ch in "xaab":
        state = pool.step(state, ord(ch))
    assert state == pool.NONE and pool.complement(pool.NONE) == pool.any_star()


def test_min_chars_is_the_shortest_match_and_most_needed_bounds_every_later_state():
    """RegexPool.min_chars: the fewest characters a state's texts have (brute force over
    short texts agrees); most_needed: no state reached from a term needs more, so a string
    body's count past it (and the longest token) tells no mask apart (mask.py `_cap`)."""
    import itertools
    from lmprog_runtime.constrained.cfg.regex import NEVER, RegexPool
    from lmprog_runtime.constrained.cfg.regex_parse import compile_pattern
    pool = RegexPool()
    alphabet = "ab@1"
    for pattern in ("b", "^ab$", "^[a-b]+@[a-b]+$", "a|b{5}", "^(ab){2,3}$", "^a*b?$", "^1{3}a", "(a|bb)(ab|b)"):
        term = compile_pattern(pool, pattern, True)
        states = {term}
        for n in range(1, 5):
            for chars in itertools.product(alphabet, repeat=n):
                state = term
                for ch in chars:
                    state = pool.step(state, ord(ch))
                if state != pool.NONE:
                    states.add(state)
        for state in states:
            shortest = next((n for n in range(0, 9) for chars in itertools.product(alphabet, repeat=n)
                             if pool.accepts(state, "".join(chars))), NEVER)
            assert pool.min_chars(state) == shortest, (pattern, state)
            assert pool.min_chars(state) <= pool.most_needed(term), (pattern, state)
    assert pool.min_chars(pool.NONE) == NEVER and pool.most_needed(compile_pattern(pool, "a|b{5}", True)) == 5


def test_uri_format_is_rfc3986(cfg, tokenizer):
    """`format: uri` is RFC 3986's grammar: ASCII only (an IRI's `é` is written %C3%A9), a
    `%` followed by two hex digits, an IP literal in brackets, a port of digits; the
    pattern agrees with rfc3986-validator (jsonschema's uri checker) where that is present."""
    valid = ["https://example.com/a.jpg", "http://[::1]:8080/a?b=c#d", "mailto:someone@example.com",
             "urn:isbn:0451450523", "http://a/%C3%A9", "file:///etc/hosts", "tel:+1-816-555-1212"]
    invalid = ["https://example.com/a.jpg\u00e9", "http://a/%zz", "http://[::1", "http://a:b@c:d", "//a/b",
               "http://exa mple.com", "http://example.com/#a#b"]
    check(cfg, tokenizer, {"type": "string", "format": "uri"}, valid, invalid)
    try:
        from rfc3986_validator import validate_rfc3986
    except ImportError:
        return
    assert all(validate_rfc3986(u, rule="URI") for u in valid)
    assert not any(validate_rfc3986(u, rule="URI") for u in invalid)


def test_numbers_exact_bounds_and_multiple_of(cfg, tokenizer):
    check(cfg, tokenizer, {"type": "number", "minimum": 0.5, "exclusiveMaximum": 2.25},
          [0.5, 1, 2.2], [0.49, 2.25, 3])
    check(cfg, tokenizer, {"type": "number", "multipleOf": 0.1}, [0.3, 1.2, 5], [0.35])
    check(cfg, tokenizer, {"type": "integer", "minimum": -3, "maximum": 7}, [-3, 7, 0], [8, -4, 1.5])


def test_enums_consts_and_literals(cfg, tokenizer):
    big = [f"item-{i}" for i in range(5000)]
    check(cfg, tokenizer, {"enum": big}, ["item-0", "item-4999"], ["item-5000", "item"])
    check(cfg, tokenizer, {"enum": ["a", 1, None, {"k": [1]}]}, ["a", 1, None, {"k": [1]}], ["b", 2, {"k": [2]}, False])
    check(cfg, tokenizer, {"const": True}, [True], [False])


def test_unique_items_and_array_counters(cfg, tokenizer):
    check(cfg, tokenizer, {"type": "array", "uniqueItems": True}, [[1, 2, "1", {"a": 1}], []],
          [[1, 1.0], [{"a": 1, "b": 2}, {"b": 2, "a": 1}]])
    check(cfg, tokenizer, {"type": "array", "minItems": 2, "maxItems": 3, "items": {"type": "integer"}},
          [[1, 2], [1, 2, 3]], [[1], [1, 2, 3, 4], [1, "a"]])
    check(cfg, tokenizer, {"prefixItems": [{"type": "string"}, {"type": "integer"}], "items": False},
          [["a", 1], ["a"]], [["a", 1, 2], [1]])


def test_combinators_not_if_then_else(cfg, tokenizer):
    check(cfg, tokenizer, {"anyOf": [{"type": "string"}, {"type": "integer", "minimum": 5}]}, ["s", 5], [4, None])
    check(cfg, tokenizer, {"oneOf": [{"type": "integer"}, {"minimum": 2}]}, [1, 2.5], [3])
    check(cfg, tokenizer, {"allOf": [{"type": "object", "required": ["a"]}, {"required": ["b"]}]},
          [{"a": 1, "b": 2}], [{"a": 1}])
    check(cfg, tokenizer, {"not": {"type": "string"}}, [1, [2]], ["s"])
    cond = {"if": {"properties": {"k": {"const": "n"}}}, "then": {"properties": {"v": {"type": "number"}}},
            "else": {"properties": {"v": {"type": "string"}}}}
    check(cfg, tokenizer, cond, [{"k": "n", "v": 1}, {"k": "s", "v": "x"}], [{"k": "n", "v": "x"}, {"k": "s", "v": 1}])


def test_unknown_keywords_are_annotations_no_check_kept(cfg, tokenizer):
    """A keyword the dialect's validator does not know (`_format`, `x-...`) asserts nothing:
    the node keeps no residual check (its text is never captured); a known one beside it
    (`not`, or draft-04's `dependencies`) still does."""
    from lmprog_runtime.constrained.cfg.schema import SchemaCompiler

    plain = {"type": "string", "_format": "uuid", "x-kind": {"a": 1}, "maxLength": 3}
    assert SchemaCompiler(plain).compile().residual is None
    assert SchemaCompiler(dict(plain, **{"not": {"const": "ab"}})).compile().residual is not None
    deps = {"$schema": "http://json-schema.org/draft-04/schema#", "type": "object",
            "dependencies": {"a": ["b"]}, "x-note": 1}
    assert SchemaCompiler(deps).compile().residual is not None
    check(cfg, tokenizer, {"type": "object", "properties": {"id": plain}, "x-extra": True},
          [{"id": "abc"}, {"id": ""}, {}], [{"id": "abcd"}, {"id": 1}])
    check(cfg, tokenizer, deps, [{"a": 1, "b": 2}, {"b": 1}], [{"a": 1}])


def test_draft03_lacks_the_combinators(cfg, tokenizer):
    """Draft-03 has no `not`, `allOf` / `anyOf` / `oneOf`, `multipleOf`, min/maxProperties
    (its validator reads them as annotations): they constrain nothing there. Its `required`
    is a boolean in the property's own schema (the compile failed on it)."""
    d3 = "http://json-schema.org/draft-03/schema#"
    schema = {"$schema": d3, "type": ["string", "integer"], "not": {"type": "string"}, "anyOf": [{"type": "integer"}],
              "multipleOf": 2}
    validator = jsonschema.validators.validator_for(schema)(schema)
    assert all(validator.is_valid(v) for v in ["a", 3, 4])
    check(cfg, tokenizer, schema, ["a", 3, 4], [1.5, None])
    check(cfg, tokenizer, {"$schema": d3, "type": "object", "maxProperties": 1}, [{"a": 1, "b": 2}], [[]])
    required = {"$schema": d3, "type": "object",
                "properties": {"a": {"type": "string", "required": True}, "b": {"required": False}}}
    validator = jsonschema.validators.validator_for(required)(required)
    assert validator.is_valid({"a": "x", "b": 1}) and not any(validator.is_valid(v) for v in ({}, {"b": 1}, {"a": 1}))
    check(cfg, tokenizer, required, [{"a": "x"}, {"a": "x", "b": 1}], [{}, {"b": 1}, {"a": 1}])


def test_draft04_integers_take_no_fraction(cfg, tokenizer):
    """An integer is a number with a zero fractional part from draft-06 on (`1.0` is one) but
    "a JSON number without a fraction or exponent part" in draft-04 and draft-03: the `.` is
    refused after an integer's digits there, as jsonschema's Draft4Validator refuses `1.0`."""
    d4 = "http://json-schema.org/draft-04/schema#"
    cases = [
        ({"$schema": d4, "type": "integer"}, [1, -20, 0], [1.0, 2.5]),
        ({"$schema": d4.replace("04", "03"), "type": "integer"}, [7], [7.0]),
        ({"$schema": d4, "type": ["integer", "string"]}, [3, "3.0"], [3.0]),
        ({"$schema": d4, "type": "object", "properties": {"n": {"type": "integer", "minimum": 0}}},
         [{"n": 12}], [{"n": 12.0}, {"n": -1}]),
        ({"$schema": d4, "type": "number"}, [1.0, 1], []),
        ({"$schema": "http://json-schema.org/draft-06/schema#", "type": "integer"}, [1.0, 1], [1.5]),
        ({"type": "integer"}, [1.0, 1], [1.5]),
    ]
    for schema, valid, invalid in cases:
        validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)(schema)
        assert all(validator.is_valid(v) for v in valid) and not any(validator.is_valid(v) for v in invalid)
        check(cfg, tokenizer, schema, valid, invalid)


def test_object_keywords(cfg, tokenizer):
    check(cfg, tokenizer, {"propertyNames": {"pattern": "^[a-z]+$"}}, [{"ab": 1}], [{"aB": 1}])
    # branches of a key's rule: checked on each key's text (they were dropped, any key taken)
    check(cfg, tokenizer, {"propertyNames": {"const": "foo", "anyOf": [{"maxLength": 2}, {"type": "number"}]}},
          [{}], [{"foo": 1}, {"bar": 1}, {"fo": 1}])
    check(cfg, tokenizer, {"propertyNames": {"oneOf": [{"maxLength": 2}, {"pattern": "^x"}]}},
          [{"ab": 1}, {"xyz": 2}, {}], [{"xy": 2}, {"abc": 1}])
    check(cfg, tokenizer, {"minProperties": 1, "maxProperties": 2}, [{"a": 1}, {"a": 1, "b": 2}],
          [{}, {"a": 1, "b": 2, "c": 3}])
    check(cfg, tokenizer, {"dependentRequired": {"a": ["b"]}}, [{"a": 1, "b": 2}, {"b": 1}], [{"a": 1}])
    check(cfg, tokenizer, {"dependentSchemas": {"a": {"required": ["c"]}}}, [{"a": 1, "c": 2}], [{"a": 1}])
    check(cfg, tokenizer, {"patternProperties": {"^x-": {"type": "integer"}}, "additionalProperties": False},
          [{"x-a": 1}], [{"x-a": "s"}, {"y": 1}])


def test_a_checked_literal_under_an_undeclared_key(cfg, tokenizer):
    """A literal (`null`, `true`) whose value a check reads, under an additionalProperties key:
    the literal's end is decided ahead through the object's abstracted key (it raised)."""
    check(cfg, tokenizer, {"additionalProperties": {"type": "null", "enum": [1, "a", None, [1], {"a": 1}]}},
          [{"foo": None}, {"a": None, "b": None}, {}], [{"foo": []}, {"foo": {}}, {"a": 1}])
    check(cfg, tokenizer, {"additionalProperties": {"enum": [1, True, [1]]}},
          [{"a": True}, {"a": True, "b": [1]}, {"foo": 1}], [{"foo": None}, {"a": True, "b": None}, {"foo": []}])


def test_unique_items_under_a_check_keep_their_items_seen(cfg, tokenizer):
    """Under a pending check (contains), a uniqueItems array's masks are shared across its
    check's start offsets but not across its items seen: after `[false,` the token `false`
    (a duplicate) is not offered, though after `[true,` (met first, in the warm-up) it is."""
    schema = {"prefixItems": [{"type": "boolean"}, {"type": "boolean"}], "uniqueItems": True,
              "minContains": 2, "contains": {"type": "integer"}}
    check(cfg, tokenizer, schema, [[True, False, 1, 2], [False, True, 3, 4]], [[False, False, 1, 2], [True, True, 1, 2]])


def test_all_of_parts_are_not_joined_where_keywords_act_only_beside_each_other(cfg, tokenizer):
    """`then` / `else` apply only beside their `if`, `minContains` only beside `contains`: in
    different allOf parts they do nothing, so the parts are not merged into one schema."""
    check(cfg, tokenizer, {"allOf": [{"if": {"exclusiveMaximum": 0}}, {"then": {"minimum": -10}},
                                     {"else": {"multipleOf": 2}, "oneOf": [{"type": "string"}, {"type": "integer"}]}]},
          [-100, 3, 1, "a"], [1.5, None])
    check(cfg, tokenizer, {"allOf": [{"contains": {"type": "integer"}}, {"minContains": 2}]}, [[1], [1, 2]], [[], ["a"]])


def test_formats_assert_inside_checks_too(cfg, tokenizer):
    """Where `format` asserts (no `$schema`, draft-07), it asserts inside the checks that read
    a value whole (`not`, `anyOf` over keys ...) as in the grammar: `not` a date refuses one."""
    check(cfg, tokenizer, {"not": {"type": "string", "format": "date"}}, ["x", 1, "2020-02-30"], ["2020-01-01"])
    check(cfg, tokenizer, {"propertyNames": {"not": {"enum": ["1", "3"], "format": "email"}}}, [{"1": 0}], [])
    check(cfg, tokenizer, {"$schema": "https://json-schema.org/draft/2020-12/schema",  # (an annotation there)
                           "not": {"type": "string", "format": "date"}}, [1], ["x", "2020-01-01"])


def test_regex_kind_and_masks_agree_with_acceptance(cfg, tokenizer):
    assert accepts(cfg, tokenizer, r"[0-9]{2,3}", "123", kind="regex")
    assert not accepts(cfg, tokenizer, r"[0-9]{2,3}", "1", kind="regex")
    assert not accepts(cfg, tokenizer, r"[0-9]{2,3}", "1234", kind="regex")
    assert accepts(cfg, tokenizer, r"(yes|no) because .{1,20}", "no because it is", kind="regex")


def test_random_walks_produce_valid_instances(cfg, tokenizer):
    schema = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1}, "tags": {
        "type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "name": {"type": "string", "maxLength": 8}}, "required": ["id", "name"], "additionalProperties": False}
    g0 = compile_(cfg, schema)
    rng = random.Random(0)
    row = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    done = 0
    for _ in range(12):
        g, out = g0.copy(), []
        for _step in range(60):
            row.numpy().fill(False)
            g.fill_mask(row)
            allowed = row.nonzero().flatten().tolist()
            t = rng.choice(allowed)
            g.accept_token(t)
            if t == tokenizer.eos_token_id:
                break
            out.append(t)
        if g.finished:
            jsonschema.validate(json.loads(b"".join(cfg.table[t] for t in out).decode()), schema)
            done += 1
    assert done >= 1


def test_rollback_and_jump_forward(cfg, tokenizer):
    schema = dict(PERSON, additionalProperties=False)
    g = compile_(cfg, schema)
    ids = tokenizer.encode('{"name": "x", "age": 3', add_special_tokens=False)
    for t in ids:
        g.accept_token(t)
    state = g.state
    g.rollback(3)
    for t in ids[-3:]:
        g.accept_token(t)
    assert g.state == state
    g2 = compile_(cfg, {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"],
                        "additionalProperties": False})
    assert g2.jump_forward_str() == "{"  # then whitespace or a key: nothing more is forced
    for t in tokenizer.encode('{"', add_special_tokens=False):
        g2.accept_token(t)
    assert g2.jump_forward_str() == 'name"'


def _forced_every_byte(g):
    """jump_forward_str's answer by stepping all 256 bytes at every position (its definition)."""
    from lmprog_runtime.constrained.cfg.backend import MAX_FORCED_BYTES, whole_characters

    if g.is_terminated():
        return None
    m, state, out, base = g._shared.machine, g.state, bytearray(), len(g._hist)
    while len(out) < MAX_FORCED_BYTES:
        ctx = g._ctx(bytes(out) + b"\x00")
        if m.accepting(state, base + len(out), ctx):
            break
        live = [(b, s) for b in range(256) for s in (m.advance(state, b, base + len(out), ctx),) if s]
        if len(live) > 1:
            live = [(b, s) for b, s in live if b != 0x5C]
        if len(live) != 1:
            break
        out.append(live[0][0])
        state = live[0][1]
    return whole_characters(out)


def test_jump_forward_search_stops_early_with_the_same_answer(cfg, tokenizer):
    """The forced-byte search stops at a state's second live byte; at every token of these
    instances its answer equals stepping all 256 bytes."""
    cases = [
        (dict(PERSON, additionalProperties=False), '{"name": "Zoë \\"Z\\"", "age": 41}'),
        ({"type": "object", "properties": {"id": {"type": "string", "format": "uuid"},
                                           "kind": {"enum": ["alpha", "alphabet", "beta"]},
                                           "n": {"type": "number", "minimum": 1.5, "maximum": 99}},
          "required": ["id", "kind", "n"]},
         '{\n  "id": "123e4567-e89b-12d3-a456-426614174000",\n  "kind": "alphabet", "n": 12.25}'),
        ({"type": "array", "items": {"type": "boolean"}, "maxItems": 3}, "[true, false,null]"),
        ("regex", r"(ab|ac)d\\[e-g]{2}x", "acd\\efx"),
        ("ebnf", 'root ::= "The capital is " ("Rome" | "Rouen") "."', "The capital is Rouen."),
    ]
    checked = 0
    for case in cases:
        kind, spec, text = (case[0], case[1], case[2]) if len(case) == 3 else ("json", case[0], case[1])
        g = compile_(cfg, spec, kind)
        for t in tokenizer.encode(text, add_special_tokens=False):
            assert g.jump_forward_str() == _forced_every_byte(g), (spec, g._hist)
            checked += 1
            try:
                g.accept_token(t)
            except GrammarError:
                break  # an invalid instance: the states up to here were compared
    assert checked > 40


def test_whitespace_pattern(tokenizer):
    from lmprog_runtime.constrained.base import GrammarBackendConfig

    for ws, ok, bad in (("", ['{"a":1}'], ['{"a": 1}']), (r"[ \n]?", ['{"a": 1}', '{\n"a":1}'], ['{"a":  1}'])):
        be = create_grammar_backend("cfg", tokenizer, 49152 + 64, [tokenizer.eos_token_id],
                                    config=GrammarBackendConfig(whitespace_pattern=ws))
        for text in ok:
            assert accepts(be, tokenizer, {"type": "object"}, text), (ws, text)
        for text in bad:
            assert not accepts(be, tokenizer, {"type": "object"}, text), (ws, text)
        be.shutdown()


def test_free_text_regex_mask_is_fast_and_exact(cfg, tokenizer):
    rx = r"[a-z ]{20,40}\."
    g = compile_(cfg, rx, "regex")
    row = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t0 = time.perf_counter()
    g.fill_mask(row)
    assert time.perf_counter() - t0 < 2.0
    allowed = row.nonzero().flatten().tolist()
    assert all(re.fullmatch(r"[a-z ]+", cfg.table[t].decode()) for t in allowed)
    assert tokenizer.convert_tokens_to_ids("the") in allowed
    assert accepts(cfg, tokenizer, rx, "the quick brown fox jumps.", kind="regex")
    assert not accepts(cfg, tokenizer, rx, "the quick brown fox.", kind="regex")  # 19 characters


def test_ebnf_through_the_same_engine(cfg, tokenizer):
    city = 'root ::= "The capital is " city "."\ncity ::= "Paris" | "Rome" | "Oslo"'
    assert accepts(cfg, tokenizer, city, "The capital is Rome.", kind="ebnf")
    assert not accepts(cfg, tokenizer, city, "The capital is Lyon.", kind="ebnf")
    g = compile_(cfg, city, "ebnf")
    assert g.jump_forward_str() == "The capital is "
    items = 'root ::= item ("," item)* # comment\nitem ::= [a-c] [0-9]{1,2}'
    assert accepts(cfg, tokenizer, items, "a1,b22,c3", kind="ebnf")
    assert not accepts(cfg, tokenizer, items, "a1,b222", kind="ebnf")
    for bad, fragment in (('root ::= "unclosed', "Failed to compile ebnf"), ('root ::= root "a" | "b"', "left-recursive"),
                          ("item ::= [a-z]", "no `root`")):
        with pytest.raises(GrammarError, match=fragment):
            compile_(cfg, bad, "ebnf")


def test_ebnf_recursion_deep_and_its_memo_bounded(monkeypatch):
    """A recursive rule nests as deep as the output (no bound but the output's length), and
    the expanded stacks a grammar memoizes for every request are bounded (MAX_CLOSURES):
    each level of `[` is a stack never met before."""
    from lmprog_runtime.constrained.cfg import ebnf
    monkeypatch.setattr(ebnf, "MAX_CLOSURES", 64)
    m = ebnf.EbnfMachine('root ::= "[" root "]" | "x"')
    text = b"[" * 300 + b"x" + b"]" * 300
    state = m.initial()
    for k, b in enumerate(text):
        state = m.advance(state, b, k)
        assert state and len(m._closure) <= 64
    assert m.accepting(state) and not m.advance(state, ord("]"), len(text))


def test_memos_kept_for_every_request_are_bounded(cfg, monkeypatch):
    """What a grammar memoizes from outputs lives as long as the grammar, for every request:
    undeclared keys' member rules (MAX_KEY_RULES), a closed object's key rules by the keys
    seen (MAX_VARIANTS), the regex steps by code point (MAX_DERIVATIONS) are bounded, and
    the languages are unchanged."""
    from lmprog_runtime.constrained.cfg import backend, machine as machine_mod, regex
    from lmprog_runtime.constrained.cfg.backend import accepts_text, compile_machine
    monkeypatch.setattr(backend, "MAX_KEY_RULES", 8)
    monkeypatch.setattr(machine_mod, "MAX_VARIANTS", 4)
    monkeypatch.setattr(regex, "MAX_DERIVATIONS", 16)
    m = compile_machine("json", json.dumps({"type": "object", "properties": {"p": {"type": "integer"}},
                                            "additionalProperties": {"type": "string", "pattern": "^[^z]*$"}}),
                        cfg.whitespace)
    before = len(m.root._child)
    for k in range(40):
        assert accepts_text(m, json.dumps({f"k{k}": "\u00e9" * k + chr(0x400 + k), "p": k}))
    assert not accepts_text(m, json.dumps({"k": "z"})) and not accepts_text(m, json.dumps({"p": "1"}))
    assert len(m.root._child) <= before + 1 and len(m.pool._deriv) <= 16
    names = [f"n{k}" for k in range(6)]
    closed = compile_machine("json", json.dumps({"type": "object", "properties": {n: {"type": "integer"} for n in names},
                                                 "additionalProperties": False}), cfg.whitespace)
    rng = random.Random(0)
    for _ in range(30):
        order = rng.sample(names, 4)
        assert accepts_text(closed, json.dumps({n: 1 for n in order}))
        assert not accepts_text(closed, '{"%s":1,"%s":2}' % (order[0], order[0]))
    variants = [k for k in closed.root._child if type(k) is tuple and k[0] == "__keys__"]
    assert 0 < len(variants) <= 4


def test_compile_budget_and_cache(tokenizer):
    from lmprog_runtime.constrained.base import GrammarBackendConfig

    be = create_grammar_backend("cfg", tokenizer, 49152 + 64, [tokenizer.eos_token_id],
                                config=GrammarBackendConfig(compile_timeout_s=0.0))
    wide = {"type": "object", "properties": {f"k{i}": {"type": "string", "pattern": f"^v{i}[a-z]+$"}
                                             for i in range(800)}}
    with pytest.raises(GrammarError, match="timed out|budget"):
        be.get_future("json", json.dumps(wide)).result(timeout=60)
    be.shutdown()
    be = create_grammar_backend("cfg", tokenizer, 49152 + 64, [tokenizer.eos_token_id])
    spec = json.dumps(wide)
    t0 = time.perf_counter()
    be.get_future("json", spec).result(timeout=60)
    assert time.perf_counter() - t0 < 5.0  # 800 patterned properties: a lazy rule each
    assert be.get_future("json", spec).done()  # cached by spec
    be.shutdown()


def test_residual_checks_memoized_per_text_and_bounded(monkeypatch):
    from lmprog_runtime.constrained.cfg import residual as res

    schema = {"type": "object", "properties": {"k": {"not": {"const": "x"}}}}
    r = res.Residual(schema)
    sub = schema["properties"]["k"]
    monkeypatch.setattr(res, "MEMO_TEXTS", 2)
    assert [r.valid_text(t, sub) for t in (b'"x"', b'"x"', b'"y"', b'"x"')] == [False, False, True, False]
    assert len(r._memo) <= 2
    long = b'"' + b"y" * 300 + b'"'
    assert r.valid_text(long, sub) and (id(sub), long) not in r._memo
    assert not r.valid_text(b'"x', sub)  # (not JSON: refused, never memoized as valid)


def test_rows_written_and_ored_equal_the_engine_mask(cfg, tokenizer):
    """write_mask / fill_mask copy the engine's mask (EOS where the output may end), the
    padding past the vocabulary False, ORed into a row by fill_mask; masks met again come
    from the process-wide unpacked rows, kept by the packed array's identity."""
    import numpy as np

    from lmprog_runtime.constrained.cfg import mask as cfg_mask

    g = compile_(cfg, {"type": "object", "properties": {"a": {"type": "string"}, "n": {"type": "number"}}})
    eng, eos = g._shared.engine, tokenizer.eos_token_id
    for _ in range(2):  # (the second pass: every mask a memo hit, copied from an unpacked row)
        g = g.copy()
        for t in tokenizer.encode('{"a":"some text here","n":12.5}', add_special_tokens=False) + [eos]:
            want = np.zeros(cfg.vocab_size, dtype=np.bool_)
            want[:eng.vocab.n_slots] = eng.mask(g.state, bytes(g._hist))[:cfg.vocab_size]
            want[eos] = g._accepting()
            row = np.ones(cfg.vocab_size, dtype=np.bool_)
            g.write_mask(row)
            assert np.array_equal(row, want)
            ored = torch.zeros(cfg.vocab_size, dtype=torch.bool)
            ored[[5, cfg.vocab_size - 1]] = True
            g.fill_mask(ored)
            want[[5, cfg.vocab_size - 1]] = True
            assert np.array_equal(ored.numpy(), want)
            g.accept_token(t)
    n = eng.vocab.n_slots
    for size in (n - 1, n, n + 7):  # (shorter: the vocabulary without the trie's sink slot; longer: padded)
        row = np.ones(size, dtype=np.bool_)
        eng.write_row(g.state, bytes(g._hist), row, True)
        want = eng.mask(g.state, bytes(g._hist))
        assert np.array_equal(row[:min(n, size)], want[:size]) and not row[n:].any()
    for _ in range(2 * cfg_mask.UNPACKED_ROWS):  # (past the LRU's size: old arrays freed)
        b = np.random.rand(n) < 0.5
        assert np.array_equal(cfg_mask._unpacked(np.packbits(b, bitorder="little"), n), b)


@pytest.mark.parametrize("branches,checked", [
    ([{"type": "string"}, {"type": "null"}], False),
    ([{"type": "integer"}, {"type": "string", "maxLength": 3}, {"type": "array"}], False),
    ([{"type": "integer"}, {"type": "number"}], True),  # 1 is both
    ([{"type": "string"}, {"type": "string", "maxLength": 3}], True),
    ([{"type": "string"}, {"anyOf": [{"type": "null"}, {"type": "boolean"}]}], True),  # (a choice: not looked into)
    # objects told apart by a required property's strings (a discriminator)
    ([{"type": "object", "properties": {"k": {"enum": ["a", "b"]}, "n": {"type": "integer"}}, "required": ["k"]},
      {"type": "object", "properties": {"k": {"const": "c"}, "s": {"type": "string"}}, "required": ["k", "s"]},
      {"type": "string"}], False),
    ([{"type": "object", "properties": {"k": {"enum": ["a", "b"]}}, "required": ["k"]},
      {"type": "object", "properties": {"k": {"enum": ["b", "c"]}}, "required": ["k"]}], True),  # ("b" is both)
    ([{"type": "object", "properties": {"k": {"enum": ["a"]}}, "required": ["k"]},
      {"type": "object", "properties": {"k": {"enum": ["c"]}}}], True),  # (the second needs no "k")
    ([{"type": "object", "properties": {"k": {"enum": ["a", 1]}}, "required": ["k"]},
      {"type": "object", "properties": {"k": {"enum": ["c", 1]}}, "required": ["k"]}], True),  # (1 is both)
])
def test_one_of_exclusive_branches_need_no_whole_value_check(cfg, tokenizer, branches, checked):
    """oneOf whose branches exclude each other (no JSON type in common, integer counting as
    number; or objects whose required discriminator takes disjoint strings) is anyOf: at
    most one branch matches any value, so "exactly one" is not checked on the complete
    value (which would make every mask inside it depend on its text)."""
    from lmprog_runtime.constrained.cfg.backend import compile_machine
    schema = {"oneOf": branches}
    machine = compile_machine("json", json.dumps(schema), cfg.whitespace)
    assert (machine.root.residual is not None) == checked
    for value in ["ab", "abcd", None, 1, 1.5, [1], True, {"a": 1}, {"k": "a"}, {"k": "b"}, {"k": "c"},
                  {"k": "c", "s": "x"}, {"k": "a", "n": 2}, {"k": 1}, {"k": "b", "s": "x", "n": 1}]:
        want = jsonschema.Draft202012Validator(schema).is_valid(value)
        assert accepts(cfg, tokenizer, schema, json.dumps(value)) == want, value


@pytest.mark.parametrize("schema", [
    {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4},
    {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}], "items": {"type": "boolean"},
     "maxItems": 3},
    {"type": "array", "prefixItems": [{"type": "string"}], "items": False},
    {"type": "array", "items": {"type": "object", "properties": {"a": {"type": "integer"}}}, "minItems": 1},
])
def test_array_counts_are_kept_as_far_as_checks_tell_them_apart(cfg, tokenizer, schema):
    """An array frame keeps its item count exactly up to the largest count that minItems,
    maxItems or prefixItems tell apart, then that count: every later item is in the state of
    the one before (masks shared), and lengths are still checked exactly."""
    items = ["a", 1, True, False, {"a": 2}, True, {"a": 3}]
    validator = jsonschema.Draft202012Validator(schema)
    for n in range(7):
        for value in (items[:n], [1] * n, [{"a": k} for k in range(n)], ["x", 2] + [True] * n):
            assert accepts(cfg, tokenizer, schema, json.dumps(value)) == validator.is_valid(value), value


@pytest.mark.parametrize("schema,cap", [({"type": "array", "items": {"type": "integer"}}, 0),
                                        ({"type": "array", "items": {"type": "integer"}, "minItems": 2}, 2),
                                        ({"type": "array", "prefixItems": [{"type": "integer"}], "maxItems": 3}, 3)])
def test_array_items_past_the_counts_checked_share_one_state(cfg, schema, cap):
    from lmprog_runtime.constrained.cfg.backend import compile_machine
    machine = compile_machine("json", json.dumps(schema), cfg.whitespace)
    states = []
    for n in range(cap + 3):
        state = machine.initial()
        for pos, b in enumerate(b"[" + b"1," * n):
            state = machine.advance(state, b, pos, lambda a, b: b"")
        states.append(state)
    assert len(set(states[:cap + 1])) == cap + 1  # told apart up to the cap
    assert all(states[cap + 1:]) == (cap < 3) and (cap == 3 or states[cap + 1] == states[cap + 2])


def test_subschemas_of_one_scalar_rule_share_one_node(cfg, tokenizer):
    """Properties whose schemas compile to the same scalar rule (annotations aside) are one
    node, so their values share matcher states and masks; rules that differ in anything
    the matcher reads, or that carry a check, stay apart, and every instance is decided
    as before."""
    from lmprog_runtime.constrained.cfg.backend import compile_machine
    schema = {"type": "object", "properties": {
        "w": {"type": "number", "description": "width"}, "h": {"type": "number", "title": "height"},
        "d": {"type": "number", "minimum": 0}, "n": {"type": "integer"}, "s": {"type": "string", "maxLength": 3},
        "t": {"type": "string", "maxLength": 3, "examples": ["ab"]}, "u": {"type": "string", "not": {"const": "x"}},
        "v": {"type": "string", "not": {"const": "y"}}, "o": {"type": "object"}, "p": {"type": "object"}}}
    props = compile_machine("json", json.dumps(schema), cfg.whitespace).root.props
    assert props["w"] is props["h"] and props["s"] is props["t"]
    assert len({id(props[k]) for k in "wdn"}) == 3 and props["u"] is not props["v"] and props["o"] is not props["p"]
    check(cfg, tokenizer, schema, [{"w": 1.5, "h": -2, "d": 0, "n": 3, "s": "abc", "t": "", "u": "y", "v": "x"}],
          [{"d": -1}, {"n": 1.5}, {"t": "abcd"}, {"u": "x"}, {"v": "y"}, {"h": "1"}])


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"a": {"type": "integer"}}, "patternProperties": {"^x": {"type": "string"}},
     "unevaluatedProperties": False},
    {"type": "object", "properties": {"a": {"type": "integer"}}, "unevaluatedProperties": {"type": "boolean"}},
    {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": {"type": "integer"},
     "unevaluatedProperties": False},
    {"type": "array", "prefixItems": [{"type": "string"}], "unevaluatedItems": {"type": "integer"}},
    {"type": "array", "prefixItems": [{"type": "string"}], "items": {"type": "boolean"}, "unevaluatedItems": False},
    {"type": "array", "contains": {"type": "string"}, "unevaluatedItems": {"type": "integer"}},
    {"type": "object", "allOf": [{"properties": {"b": True}}], "properties": {"a": True},
     "unevaluatedProperties": False},
    {"type": "object", "allOf": [{"allOf": [{"$ref": "#/$defs/b"}], "patternProperties": {"^x": {"type": "string"}}}],
     "properties": {"a": {"type": "integer"}}, "unevaluatedProperties": False, "$defs": {"b": {"properties": {"b": True}}}},
    {"$ref": "#/$defs/b", "properties": {"a": {"type": "integer"}}, "unevaluatedProperties": {"type": "integer"},
     "$defs": {"b": {"properties": {"b": {"type": "boolean"}}}}},
    {"type": "object", "not": {"required": ["c"]}, "properties": {"a": True}, "unevaluatedProperties": False},
    {"allOf": [{"additionalProperties": {"type": "integer"}}], "unevaluatedProperties": False},
    {"allOf": [{"prefixItems": [{"type": "string"}]}], "unevaluatedItems": {"type": "integer"}},
    {"allOf": [{"prefixItems": [{"type": "string"}]}, {"minItems": 1}], "unevaluatedItems": False},
    {"anyOf": [{"properties": {"b": True}}, {"properties": {"x1": True}}], "properties": {"a": True},
     "unevaluatedProperties": False},
    {"allOf": [{"if": {"required": ["a"]}, "then": {"properties": {"b": True}}}], "properties": {"a": True},
     "unevaluatedProperties": False},
    {"allOf": [{"contains": {"type": "string"}}], "unevaluatedItems": {"type": "integer"}},
    {"if": {"required": ["a"]}, "then": {"properties": {"b": True}}, "else": {"properties": {"c": True}},
     "properties": {"a": True}, "unevaluatedProperties": False},
    {"properties": {"a": True}, "dependentSchemas": {"a": {"properties": {"c": True}}}, "unevaluatedProperties": False},
    {"anyOf": [{"$ref": "#/$defs/b"}, {"properties": {"x1": True}}], "unevaluatedProperties": False,
     "$defs": {"b": {"properties": {"b": True}}}},
    {"oneOf": [{"properties": {"b": True}, "required": ["b"]}, {"properties": {"c": True}, "required": ["c"]}],
     "unevaluatedProperties": False},
    {"properties": {"a": True}, "if": {"required": ["a"]}, "then": {"$ref": "#/$defs/bc"}, "unevaluatedProperties": False,
     "$defs": {"bc": {"oneOf": [{"properties": {"b": True}}, {"properties": {"c": True}, "required": ["c"]}]}}},
    {"$schema": "https://json-schema.org/draft/2019-09/schema", "allOf": [{"items": [{"type": "string"}]}],
     "unevaluatedItems": {"type": "integer"}},
    {"$schema": "https://json-schema.org/draft/2019-09/schema", "unevaluatedItems": False,
     "allOf": [{"items": [{"type": "string"}], "additionalItems": {"type": "integer"}}]},
])
def test_unevaluated_keywords_as_structure_where_nothing_else_evaluates(cfg, tokenizer, schema):
    """unevaluatedProperties / unevaluatedItems beside no in-place applicator, or beside
    only those that apply whatever the instance (allOf, `$ref`, `not`), are the structure
    they stand for (additionalProperties / items past every member / item the parts
    declare, nothing where a part evaluates them all: no check on the complete value);
    beside one whose annotations depend on which branches pass (anyOf, if, contains) they
    stay checks. Either way every instance is decided as the JSON Schema validator decides it."""
    from lmprog_runtime.constrained.cfg.backend import compile_machine
    machine = compile_machine("json", json.dumps(schema), cfg.whitespace)
    text = json.dumps(schema)
    structural = not any(w in text for w in ('"contains"', '"anyOf"', '"oneOf"', '"if"', '"dependentSchemas"'))
    if "not" in schema:  # (`not {required: [c]}` is structure too: member c refused at its key)
        assert machine.root.additional is None and machine.root.residual is None
    else:
        assert (machine.root.residual is None) == structural
    validator = jsonschema.validators.validator_for(schema)(schema)
    for value in ({"a": 1}, {"a": 1, "x1": "s"}, {"a": 1, "b": True}, {"a": 1, "c": 2}, {"x2": 3}, {"b": 1}, {"c": 1},
                  ["s"], ["s", 1, 2], ["s", True], [1, "s"], ["s", "t"], [], ["s", 1, True]):
        assert accepts(cfg, tokenizer, schema, json.dumps(value)) == validator.is_valid(value), (schema, value)


@pytest.mark.parametrize("schema,dead,live", [
    ({"type": "number", "not": {"minimum": 0}}, "5", "-5"),
    ({"not": {"type": "string"}}, '"', "1"),
    ({"type": ["number", "string", "null"], "not": {"type": ["number", "null"]}}, "1", '"a"'),
    ({"not": {"maximum": 3}}, '"', "4"),
    ({"type": ["integer", "string"], "not": {"exclusiveMinimum": 3}, "maximum": 1}, "2", "1"),
    ({"properties": {"a": {"type": "integer"}}, "not": {"required": ["a"]}}, '{"a"', '{"b":2}'),
    ({"not": {"required": ["a", "b"]}}, '{"a":1,"b"', '{"a":1,"c":2}'),
    ({"properties": {"a": {"type": "integer"}}, "required": ["c"], "not": {"required": ["b", "a", "c"]}},
     '{"c":1,"b":2,"a"', '{"a":1,"c":2}'),
    ({"additionalProperties": {"type": "integer"}, "patternProperties": {"^x": {"type": "integer"}},
      "not": {"required": ["b", "a"]}}, '{"a":1,"x1":2,"b"', '{"a":1,"x1":3}'),
    ({"type": "object", "properties": {"a": False, "b": {}}}, '{"a"', '{"b":1}'),
    ({"properties": {"a": False}, "patternProperties": {"^x": False}, "additionalProperties": False}, '{"x1"', "{}"),
    ({"type": "string", "not": {"pattern": "ab"}}, '"xa\\u0062', '"xa"'),  # (b escaped: decoded first)
    ({"not": {"pattern": "^[a-c]+$"}, "maxLength": 3}, "1", '"ab1"'),
    ({"type": ["string", "integer"], "not": {"pattern": "\\d$", "title": "no digit last"}, "pattern": "^x"},
     '"x1"', '"x1a"'),
    # draft-04 (boolean exclusive bounds: `not {minimum}` stays a check there; `type`, `required` do not)
    ({"$schema": "http://json-schema.org/draft-04/schema#", "type": ["string", "integer"], "not": {"type": "string"}},
     '"', "1"),
    ({"$schema": "http://json-schema.org/draft-04/schema#", "properties": {"a": {}}, "not": {"required": ["a"]}},
     '{"a"', '{"b":1}'),
])
def test_a_not_one_keyword_decides_is_refused_where_it_becomes_certain(cfg, tokenizer, schema, dead, live):
    """`not {minimum: x}` (and the other bounds) is a number past the other side, `not
    {pattern: P}` a string P's search finds nothing in (the complement pattern: dead at
    the character completing a match), `not {required: [k]}` an object without k, `not {required: [k1, k2]}` one without k1 or
    without k2 (anyOf branches: schema.py _not_decided_early), and a member whose
    value no schema admits is refused at its key's closing quote (backend._child): so the
    first byte no value can finish from is dead (`5` under `not {minimum: 0}` used to start
    a number only its end refused, a member `a` an object that could never close), and
    every instance is decided as the JSON Schema validator decides it."""
    from lmprog_runtime.constrained.cfg.backend import compile_machine
    machine = compile_machine("json", json.dumps(schema), cfg.whitespace)
    assert machine.root.residual is None  # (no check left at the value's end)

    def alive(text: str) -> bool:
        state = machine.initial()
        for k, b in enumerate(text.encode()):
            state = machine.advance(state, b, k, lambda a, e: text.encode()[a:e])
            if not state:
                return False
        return True
    assert not alive(dead) and alive(live)
    validator = jsonschema.validators.validator_for(schema)(schema)
    for value in (-5, 0, 1, 2, 3, 3.5, 4, "x", None, True, [1], {}, {"a": 1}, {"b": 2}, {"a": 1, "b": 2},
                  {"x1": 1}, {"c": "s"}, "xab", "abc", "ab1", "x1", "x1a", "xa", "\u00e9ab"):
        assert accepts(cfg, tokenizer, schema, json.dumps(value)) == validator.is_valid(value), (schema, value)


@pytest.mark.parametrize("schema", [
    {"type": "string", "not": {"required": ["a"]}}, {"type": "string", "not": {"type": "string"}},
    {"type": "integer", "not": {"type": "number"}}, {"type": ["string", "null"], "not": {"minimum": 3}},
    {"not": {}}, {"not": True, "type": "object"}, {"not": {"description": "anything"}},
])
def test_a_not_refusing_every_kind_the_rest_allows_is_no_value(cfg, schema):
    """Such a schema is compiled as `false` (no value at all: its first mask is empty), not
    as a check that refuses each value at its end (a string under `{"type": "string",
    "not": {"required": ["a"]}}` was begun, and no end of it taken: `required` passes
    strings)."""
    from lmprog_runtime.constrained.cfg.backend import compile_machine
    machine = compile_machine("json", json.dumps(schema), cfg.whitespace)
    assert machine.root.never
    validator = jsonschema.validators.validator_for(schema)(schema)
    assert not any(validator.is_valid(v) for v in ("a", 1, 2.5, None, True, [], {}, {"a": 1}))


def test_a_refused_compile_says_where_the_schema_is_malformed_or_refers_to_itself(cfg):
    """A schema its dialect's metaschema refuses is named at its first fault (the compiler's
    own error there said little: `'int' object is not iterable`); one that refers to itself
    where no value is read says so."""
    with pytest.raises(GrammarError, match=r"not a valid schema at '/dependentRequired/a': 1 is not of type 'array'"):
        compile_(cfg, {"dependentRequired": {"a": 1}})
    with pytest.raises(GrammarError, match="refers to itself where no value is read"):
        compile_(cfg, {"not": False, "$ref": "#"})
    with pytest.raises(GrammarError, match="lookaround"):  # (a valid schema's own reason stays)
        compile_(cfg, {"type": "string", "pattern": "(?=a)b"})


def test_an_unresolvable_reference_in_a_branch_beside_unevaluated_properties(cfg):
    """A `$ref` that resolves nowhere inside a branch is its check's to fail (the value is
    refused), not the compile's, and a pattern the structure cannot compile its check's to
    read: the bound on the members is then not made."""
    from lmprog_runtime.constrained.cfg.backend import accepts_text, compile_machine
    schema = {"properties": {"a": True}, "if": {"required": ["a"]}, "then": {"$ref": "#/$defs/missing"},
              "unevaluatedProperties": False}
    machine = compile_machine("json", json.dumps(schema), cfg.whitespace)
    assert not accepts_text(machine, '{"a":1}') and not accepts_text(machine, '{"b":1}')
    # a pattern the structure cannot take (a lookahead) in such a branch: read by the check alone
    schema = {"properties": {"a": True}, "if": {"required": ["a"]}, "then": {"patternProperties": {"^(?=x)xy": True}},
              "unevaluatedProperties": False}
    machine = compile_machine("json", json.dumps(schema), cfg.whitespace)
    assert accepts_text(machine, '{"a":1,"xy":1}') and not accepts_text(machine, '{"a":1,"z":1}')


@pytest.mark.parametrize("schema", [
    {"allOf": [{"properties": {"a": True}}], "properties": {"b": True},
     "unevaluatedProperties": {"type": "string", "pattern": "^(?=x)x"}},
    {"properties": {"a": True}, "if": {"required": ["a"]}, "then": {"properties": {"b": True}},
     "unevaluatedProperties": {"pattern": "^(?=x)x"}},
    {"allOf": [{"properties": {"a": True}}, {"patternProperties": {"^(?=x)xy": True}}], "unevaluatedProperties": False},
])
def test_unevaluated_keywords_whose_structure_cannot_be_made_stay_checks(cfg, schema):
    """Where making unevaluated* structure brings in what the structure cannot take (a
    lookahead only their check read), the schema compiles as before, the keywords checks."""
    from lmprog_runtime.constrained.cfg.backend import accepts_text, compile_machine
    machine = compile_machine("json", json.dumps(schema), cfg.whitespace)
    validator = jsonschema.Draft202012Validator(schema)
    for value in ({"a": 1, "z": "xy"}, {"a": 1, "z": "y"}, {"a": 1, "xy": 1}, {"b": 2}):
        assert accepts_text(machine, json.dumps(value, separators=(",", ":"))) == validator.is_valid(value), value


def test_unevaluated_keywords_beside_random_in_place_applicators(cfg):
    """Random objects / arrays with unevaluatedProperties / unevaluatedItems beside allOf
    (nested), `$ref`, `not`, anyOf, oneOf, if / then / else and dependentSchemas parts
    declaring properties, patternProperties,
    additionalProperties, prefixItems, items, their own unevaluated* (a third in 2019-09's
    spelling: `items` arrays, additionalItems): every instance decided at byte level as the
    validator of the schema's dialect decides it (where those parts apply whatever the
    instance, the keyword is structure: an undeclared member is refused at its key; beside
    the others, the members no part declares are refused at their key, the rest checked)."""
    from lmprog_runtime.constrained.cfg.backend import accepts_text, compile_machine
    rng = random.Random(7)
    keys = ["a", "b", "c", "xa", "xb"]

    def value():
        return rng.choice([True, False, {"type": "integer"}, {"type": "string"}, {"const": 1}])

    def part(depth):
        s = {}
        for word, p, make in (
                ("properties", 0.6, lambda: {k: value() for k in rng.sample(keys, rng.randint(1, 2))}),
                ("patternProperties", 0.3, lambda: {"^x": value()}), ("additionalProperties", 0.15, value),
                ("unevaluatedProperties", 0.15, value), ("required", 0.15, lambda: rng.sample(keys, 1)),
                ("prefixItems", 0.3, lambda: [value() for _ in range(rng.randint(1, 2))]), ("items", 0.25, value),
                ("unevaluatedItems", 0.1, value)):
            if rng.random() < p:
                s[word] = make()
        if depth < 2 and rng.random() < 0.4:
            s["allOf"] = [part(depth + 1) for _ in range(rng.randint(1, 2))]
        if depth == 0 and rng.random() < 0.3:
            s["$ref"] = "#/$defs/d"
        if depth < 2 and rng.random() < 0.15:
            s["not"] = {"required": [rng.choice(keys)]}
        if depth < 2 and rng.random() < 0.1:
            s["anyOf"] = [part(depth + 1), part(depth + 1)]
        if depth < 2 and rng.random() < 0.1:
            s["oneOf"] = [part(depth + 1), part(depth + 1)]
        if depth < 2 and rng.random() < 0.1:
            s.update({"if": {"required": [rng.choice(keys)]}, "then": part(depth + 1), "else": part(depth + 1)})
        if depth < 2 and rng.random() < 0.1:
            s["dependentSchemas"] = {rng.choice(keys): part(depth + 1)}
        return s

    def as_2019(s):  # (tuples as `items` arrays, the items past them as additionalItems)
        if isinstance(s, list):
            return [as_2019(x) for x in s]
        if not isinstance(s, dict):
            return s
        out = {k: as_2019(v) for k, v in s.items() if k not in ("prefixItems", "items")}
        if "prefixItems" in s:
            out["items"] = as_2019(s["prefixItems"])
            if "items" in s:
                out["additionalItems"] = as_2019(s["items"])
        elif "items" in s:  # (a boolean there as an object: jsonschema's 2019-09 item annotations take its len())
            out["items"] = s["items"] if not isinstance(s["items"], bool) else {} if s["items"] else {"not": {}}
        return out

    structural = valid = 0
    for k in range(300):
        schema = part(0)
        schema["unevaluatedProperties" if rng.random() < 0.6 else "unevaluatedItems"] = value()
        schema["$defs"] = {"d": part(2)}
        if k % 3 == 0:
            schema = dict(as_2019(schema), **{"$schema": "https://json-schema.org/draft/2019-09/schema"})
        machine = compile_machine("json", json.dumps(schema), cfg.whitespace)
        validator = jsonschema.validators.validator_for(schema)(schema)
        structural += machine.root.residual is None
        for _ in range(30):
            if rng.random() < 0.7:
                x = {k: rng.choice([1, "s", True]) for k in rng.sample(keys, rng.randint(0, 3))}
            else:
                x = [rng.choice([1, "s", True]) for _ in range(rng.randint(0, 3))]
            got = accepts_text(machine, json.dumps(x, separators=(",", ":")))
            assert got == validator.is_valid(x), (schema, x)
            valid += got
    assert structural >= 30 and valid >= 1000  # (the structural path and valid instances were met)


@pytest.mark.parametrize("schema,kinds", [
    ({"contains": {"const": 1}}, {"array"}),
    ({"contains": False}, {"array"}),
    ({"dependentSchemas": {"a": {"required": ["b"]}}, "minItems": 2}, {"object"}),
    ({"if": {"const": 0}}, set()),  # (if alone asserts nothing)
    ({"if": {"const": 0}, "contains": {"const": 1}}, {"array"}),
    ({"if": {"type": "string"}, "then": {"maxLength": 2}}, {"string"}),
    ({"if": {"properties": {"k": {"const": "n"}}}, "then": {"required": ["v"]}, "else": {"maxProperties": 1}},
     {"object"}),
    ({"if": {"type": "integer"}, "else": {"type": "string"}}, {"number", "object", "array", "boolean", "null"}),
    ({"if": {"maxLength": 4}, "then": {"const": "yes"}, "else": {"const": "other"}},
     {"string", "number", "object", "array", "boolean", "null"}),
    ({"if": {"minimum": 0}, "then": {"$ref": "#/$defs/a"}, "$defs": {"a": {"type": "string"}}},
     {"string", "number", "object", "array", "boolean", "null"}),  # (`if: true` is its `then`: no check)
    ({"not": {"type": "integer"}}, {"number"}),  # (`not S` refuses only kinds S accepts some of)
    ({"not": {"anyOf": [{"const": "x"}, {"type": "array", "maxItems": 1}]}}, {"string", "array"}),
    ({"not": {"allOf": [{"type": ["string", "null"]}, {"enum": ["a", 1, None]}]}, "contains": {"const": 1}},
     {"null", "string", "array"}),
    ({"not": {"required": ["a"], "minProperties": 2}}, {"string", "number", "object", "array", "boolean", "null"}),
    ({"not": {"not": {}}}, set()),
    ({"not": {"not": {"type": ["string", "integer"]}}}, {"number", "object", "array", "boolean", "null"}),
    ({"oneOf": [{"type": "number"}, {"minimum": 2}]}, {"number"}),  # (oneOf: the kinds two branches take)
    ({"enum": [1, "a", None]}, {"number"}),  # (an enum's numbers, objects, arrays: compared whole)
    ({"enum": [{"a": 1}, "x", True, [2]]}, {"object", "array"}),
    ({"enum": [1.5, "x"], "not": {"const": "x"}}, {"number", "string"}),
    ({"$schema": "http://json-schema.org/draft-07/schema#", "dependencies": {"a": {"required": ["b"]}}}, {"object"}),
    # (strings: two branches take every one, so none is a value; numbers: two take some)
    ({"oneOf": [{"type": "integer"}, {"type": ["number", "string"]}, {"type": "string"}]}, {"number"}),
    ({"not": {"type": "object"}, "contains": {"type": "string"}}, {"array"}),  # (`not {type}`: the other types)
    ({"type": ["array", "string"], "contains": {"type": "string"}, "maxLength": 3}, {"array"}),
])
def test_a_check_captures_only_the_kinds_it_asserts_of(cfg, tokenizer, schema, kinds):
    """A node checked for keywords that assert something of one kind of value only
    (`contains` of arrays, `dependentSchemas` of objects; `if` / `then` / `else` of the kinds
    a branch that applies may refuse; `not S` of the kinds S accepts some value of; oneOf's
    "exactly one" of the kinds two branches take) captures no value of another kind:
    a string under `{"contains": false}` or `{"not": {"type": "integer"}}` is walked
    without a pending check (its masks never read its text), and every instance is still
    decided as the JSON Schema validator decides it."""
    from lmprog_runtime.constrained.cfg.backend import compile_machine
    machine = compile_machine("json", json.dumps(schema), cfg.whitespace)
    root = machine.root
    assert root.residual is not None and (root.checked_kinds is None) == (kinds is None)
    assert kinds is None or root.checked_kinds == kinds
    for first, kind in ((b'"', "string"), (b"[", "array"), (b"{", "object"), (b"1", "number"), (b"t", "boolean")):
        state = machine.advance(machine.initial(), first[0], 0, lambda a, b: b"")
        captured = any(st[1] is not None and st[1][0][0] == "C" for st in state)
        assert captured == (bool(state) and (kinds is None or kind in kinds)), (schema, kind)
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)(schema)
    for value in ("ab", "abcd", "a", "x", 0, 1, 1.5, None, True, [], [1], [2], ["s"], ["s", 1], {}, {"a": 1},
                  {"a": 1, "b": 2}):
        assert accepts(cfg, tokenizer, schema, json.dumps(value)) == validator.is_valid(value), (schema, value)


def test_keys_matching_the_same_patterns_share_one_value_rule(cfg, tokenizer):
    """A key that several patternProperties (or a property and a pattern) apply to takes
    the rule of all of them together: one rule per set of rules that apply, not per key, so
    every such key's value shares its states and masks; each is still decided as the JSON
    Schema validator decides it."""
    from lmprog_runtime.constrained.cfg.backend import compile_machine
    schema = {"patternProperties": {"a*": {"type": "integer"}, "aaa*": {"maximum": 20}, "^b": {"minimum": 3}},
              "properties": {"ab": {"multipleOf": 2}}}
    machine = compile_machine("json", json.dumps(schema), cfg.whitespace)
    child = machine._child_of
    assert child(machine.root, "aaaa") is child(machine.root, "xaaab") is not child(machine.root, "a")
    assert child(machine.root, "ba") is child(machine.root, "bxa") is not child(machine.root, "bxaaa")
    validator = jsonschema.Draft202012Validator(schema)
    for value in ({"aaaa": 18}, {"aaaa": 21}, {"xaaab": 20.5}, {"a": 21}, {"ba": 2}, {"ba": 3}, {"bxaaa": 21},
                  {"ab": 3}, {"ab": 4}, {"b": 2.5}, {"aaa": 20, "ba": 4, "ab": 2}):
        assert accepts(cfg, tokenizer, schema, json.dumps(value)) == validator.is_valid(value), value


def test_an_integers_multiple_of_a_unit_fraction_reads_no_digits(cfg, tokenizer):
    """multipleOf 1 / k (1, 0.5, 1e-8) holds for every integer: an integer rule keeps no
    such check, so its digits stay free (one state for every number, not one per text);
    other multiples are still decided exactly."""
    from lmprog_runtime.constrained.cfg.backend import compile_machine
    for m, kept in ((1, False), (0.5, False), (1e-8, False), (3, True), (0.3, True), (2.5, True)):
        root = compile_machine("json", json.dumps({"type": "integer", "multipleOf": m}), cfg.whitespace).root
        assert (root.multiple_of is not None) == kept, m
    assert compile_machine("json", json.dumps({"type": "number", "multipleOf": 0.5}), cfg.whitespace).root.multiple_of
    check(cfg, tokenizer, {"type": "integer", "multipleOf": 1e-8}, [12391239123, 0, -7, 1.0], [1.5, "1"])
    check(cfg, tokenizer, {"type": "integer", "multipleOf": 2.5}, [5, 0, -10], [2, 7])


@pytest.mark.parametrize("schema", [
    {"type": "object"},
    {"type": "object", "properties": {"a": {}}, "additionalProperties": {"type": "integer"}},
    {"type": "object", "propertyNames": {"enum": ["\udc00x", "y"]}},
    {"enum": ["\udc00x", "y", {"\ud800": 1}]},
])
def test_a_lone_surrogate_escape_in_a_key_or_an_enum_is_read_as_any_text(cfg, tokenizer, schema):
    """JSON spells a lone surrogate only as a `\\u` escape, and UTF-8 cannot encode one: a
    key or an enum member holding one is never read off raw output (the C walk's key closes,
    the enum's next bytes) and its masks are made as for any other text. Before, the mask
    raised UnicodeEncodeError at such a key (a model writing `{"\\uddaf":1,"` under a
    free-form object failed its request there)."""
    validator = jsonschema.validators.validator_for(schema)(schema)
    for text in ('{"\\uddaf":1,"b":2}', '{"\\uddaf":1,"\\uddaf":2}', '{"\\uddaf":1,"\\uddae":{"\\ud800":[]}}',
                 '{"\\udc00x":1,"y":2}', '{"\\udc00x":1,"\\udc00x":2}', '"\\udc00x"', '"y"', '{"\\ud800":1}'):
        value = json.loads(text, object_pairs_hook=lambda pairs: dict(pairs) if len({k for k, _ in pairs}) == len(
            pairs) else None)
        want = value is not None and validator.is_valid(value)
        assert accepts(cfg, tokenizer, schema, text) == want, (schema, text)
