"""Compiled checks (cfg/predicates.py) answer as the validator does: on every schema of the
JSON-Schema-Test-Suite (draft 2020-12) and of the JSONSchemaBench dev sample the compiler
takes, on its own instances, and on every subschema of it against every value nested in
those instances and a set of probes."""
import json
import pathlib

import pytest
from jsonschema import Draft7Validator

from lmprog_runtime.constrained.cfg import predicates
from lmprog_runtime.constrained.cfg.refs import RefIndex
from lmprog_runtime.constrained.cfg.registry import SchemaRegistry
from lmprog_runtime.constrained.cfg.residual import Residual

DATA = pathlib.Path(__file__).resolve().parents[1] / "data"
SUITE = DATA / "json-schema-test-suite"
REMOTES = (("http://localhost:1234/", str(SUITE / "remotes")),)
PROBES = ["abc", "", "foo", 12.5, -1.5, 0, 1, 1.0, 2, -7, 1e300, True, False, None, [], {}, [1, 1], [1, 1.0],
          [1, True], [[1], [True]], [0, False], [1, "a"], {"a": 1}, {"foo": 1, "bar": "x"}, {"a": [1, {"b": None}]}]


def _groups(corpus: str):
    if corpus == "dev":  # (one schema per file, draft-04 ones left to their own validator)
        for path in sorted((DATA / "jsonschemabench-dev").glob("*.json")):
            yield path.stem, json.loads(path.read_text())
        return
    for path in sorted((SUITE / "draft2020-12").glob("*.json")):
        for k, group in enumerate(json.loads(path.read_text())):
            yield f"{path.stem}#{k}", group


def _residual(schema, registry):
    return Residual(schema, registry, RefIndex(schema, registry).docs)


def _values(x, out):
    out.append(x)
    if isinstance(x, dict):
        for k, v in x.items():
            out.append(k)
            _values(v, out)
    elif isinstance(x, list):
        for v in x:
            _values(v, out)
    return out


def _answer(check, value):
    try:
        return check(value)
    except Exception:  # noqa: BLE001 - Residual.valid: the validator answers a check that raises
        return None


@pytest.fixture(scope="module")
def registry():
    return SchemaRegistry(REMOTES)


@pytest.mark.parametrize("corpus,least", [("suite", 30000), ("dev", 60000)])
def test_compiled_checks_answer_as_the_validator(registry, corpus, least):
    compiled = decisions = 0
    wrong = []
    for name, group in _groups(corpus):
        residual = _residual(group["schema"], registry)
        values = PROBES + [v for t in group["tests"] for v in _values(t["data"], [])]
        subschemas = [s for s in _values(group["schema"], []) if isinstance(s, dict)]  # (and the keys: no dicts)
        for s in subschemas or [group["schema"]]:
            try:
                validator, check = residual._validator_of(s)
            except Exception:  # noqa: BLE001 - a subschema whose scope does not resolve: never checked
                continue
            if check is None:
                continue
            compiled += 1
            for v in values:
                got = _answer(check, v)
                if got is None:
                    continue
                decisions += 1
                try:
                    want = validator.is_valid(v)
                except Exception:  # noqa: BLE001
                    want = False
                if got != want:
                    wrong.append((name, json.dumps(s)[:100], json.dumps(v)[:60], want))
        if corpus == "suite" and residual._validator_of(group["schema"])[1] is not None:
            for t in group["tests"]:  # the root: the suite's own verdicts (dev's assert `format`: the grammar's)
                assert residual.valid(t["data"], group["schema"]) == t["valid"], (name, t["description"])
    assert not wrong, wrong[:10]
    assert compiled > 1000 and decisions > least, (compiled, decisions)


def test_what_is_not_compiled_is_left_to_the_validator(registry):
    def check(schema):
        return Residual(schema, registry, {})._validator_of(schema)[1]

    base = {"$schema": "https://json-schema.org/draft/2020-12/schema"}
    assert check({**base, "type": "integer", "minimum": 2}) is not None
    assert check({**base, "pattern": "(?<"}) is None  # (Python's re refuses it)
    assert check({**base, "$ref": "http://unknown.test/x.json"}) is None
    assert check({**base, "type": "integr"}) is None
    # a rule left half-made by a refused compile is not reused by the next one
    doc = {**base, "$defs": {"odd": {"type": "string", "pattern": "(?<"}, "ok": {"type": "integer"}},
           "anyOf": [{"$ref": "#/$defs/ok"}, {"$ref": "#/$defs/odd"}]}
    residual = Residual(doc, registry, {})
    assert residual._validator_of(doc["$defs"]["odd"])[1] is None
    assert residual._validator_of(doc)[1] is None
    assert residual._validator_of(doc["$defs"]["ok"])[1] is not None
    assert residual.valid("abc", doc) is False and residual.valid(3, doc) is True
    draft7 = {"$schema": "http://json-schema.org/draft-07/schema#", "dependencies": {"a": ["b"]}}
    residual = _residual(draft7, registry)
    assert residual._validator_of(draft7)[1] is None  # another dialect: its own validator
    assert not residual.valid({"a": 1}, draft7) and Draft7Validator(draft7).is_valid({"b": 1})


def test_dynamic_references_follow_the_path_of_evaluation(registry):
    # the list's items are `$dynamicRef: #item`; entered from the root, whose own dynamic
    # anchor `item` is a string, they are strings (the list's own anchor says anything)
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": "http://dyn.test/root",
              "$ref": "list", "$defs": {"text": {"$dynamicAnchor": "item", "type": "string"},
                                        "list": {"$id": "list", "type": "array", "items": {"$dynamicRef": "#item"},
                                                 "$defs": {"any": {"$dynamicAnchor": "item"}}}}}
    residual = _residual(schema, registry)
    validator, check = residual._validator_of(schema)
    assert check is not None
    for value, want in ((["a", "b"], True), (["a", 1], False), ([["a"], "b"], False), ([], True), ("x", False)):
        assert check(value) is want is validator.is_valid(value), value
    inner = schema["$defs"]["list"]  # (checked on its own: its own anchor, anything goes)
    assert residual.valid([1, {"a": None}], inner) is True


def test_a_reference_cycle_in_place_fails_the_value_that_meets_it(registry):
    """A rule whose test would call itself on the same value (`$ref: #` at the root, in an
    allOf, under `not`, through if / then) is compiled with its reference back guarded
    (predicates._Back): a value that meets the rule again on itself is refused (the
    validator recurses until RecursionError: unchecked, never accepted), at once; one whose
    evaluation turns away before (a number under `if: {type: string}, then: {$ref: #}`) is
    decided. Compiled to C (cfg/compiled.py) such a test ran past the thread's stack instead
    of raising RecursionError, and the process died (a schema with a `$dynamicRef` checks its
    whole value: `{"$ref": "#", "$defs": {"a": {"$dynamicRef": "#x"}}}` killed it at
    compile); left to the validator, each value cost ~1000 frames to fail. A reference back
    through a member or an item is recursion into the value: followed as it is."""
    base = {"$schema": "https://json-schema.org/draft/2020-12/schema"}
    cyclic = [{**base, "$ref": "#"}, {**base, "type": "object", "allOf": [{"$ref": "#"}]},
              {**base, "not": {"$ref": "#"}}, {**base, "if": {"type": "string"}, "then": {"$ref": "#"}},
              {**base, "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"anyOf": [{"$ref": "#/$defs/a"}]}},
               "$ref": "#/$defs/a"},
              {**base, "properties": {"x": {"$ref": "#"}}, "unevaluatedProperties": False, "allOf": [{"$ref": "#"}]}]
    for schema in cyclic:
        residual = Residual(schema, registry, {})
        validator, check = residual._validator_of(schema)
        assert check is not None, schema
        for value in ("a", {"x": 1}, [1], 1, None):
            try:
                want = validator.is_valid(value)
            except RecursionError:  # (it never finishes: refused)
                want = False
            assert residual.valid(value, schema) is want, (schema, value)
    for schema in ({**base, "items": {"$ref": "#"}, "maxItems": 2}, {**base, "properties": {"a": {"$ref": "#"}}},
                   {**base, "contains": {"$ref": "#"}}, {**base, "propertyNames": {"$ref": "#"}, "maxLength": 2}):
        residual = Residual(schema, registry, {})
        validator, check = residual._validator_of(schema)
        assert check is not None, schema
        for value in ([[1], []], [[1, 2, 3]], {"a": {"a": 1}}, {"abc": 1}, "ab", [1]):
            assert check(value) is validator.is_valid(value), (schema, value)


def test_a_schema_referring_to_itself_beside_a_dynamic_reference_compiles(tmp_path):
    """The process survives compiling and masking it (run apart: a stack overflow would end
    the test run), and the value is refused where it ends (its check never finishes:
    unchecked)."""
    import subprocess
    import sys
    code = (
        "import json, torch\n"
        "from tests.tiny_model import smollm2_tokenizer\n"
        "from lmprog_runtime.constrained import create_grammar_backend\n"
        "tok = smollm2_tokenizer()\n"
        "be = create_grammar_backend('cfg', tok, len(tok), [tok.eos_token_id])\n"
        "g = be.get_future('json', json.dumps({'$ref': '#', '$defs': {'a': {'$dynamicRef': '#x'}}})).result(60)\n"
        "row = torch.zeros(len(tok), dtype=torch.bool)\n"
        "for t in tok.encode('[1,true', add_special_tokens=False):\n"
        "    g.fill_mask(row)\n"
        "    g.accept_token(t)\n"
        "g.fill_mask(row)\n"
        "print('alive', bool(row[tok.encode(']', add_special_tokens=False)[0]]))\n")
    root = pathlib.Path(__file__).resolve().parents[2]
    got = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert got.returncode == 0 and "alive False" in got.stdout, (got.returncode, got.stderr[-2000:])


def test_json_equality_and_multiples():
    eq = predicates.equal
    assert eq(1, 1.0) and eq([1, {"a": 2.0}], [1.0, {"a": 2}])
    assert not eq(True, 1) and not eq(False, 0) and not eq([True], [1]) and not eq({"a": 1}, {"a": 1, "b": 2})
    assert predicates.unique([[1], [True], [1.0, 2]]) and not predicates.unique([[1], [True], [1.0]])
    assert predicates.multiple_of(4.5, 1.5) and not predicates.multiple_of(4.5, 2)
    assert predicates.multiple_of(1e308, 0.5)  # (the quotient overflows: exact fractions)
    registry = SchemaRegistry()
    schema = {"multipleOf": 0.1}
    residual = _residual(schema, registry)
    assert all(residual.valid(x, schema) == residual._validator_of(schema)[0].is_valid(x) for x in (0.3, 0.7, 3, 1e-9))
    big = {"multipleOf": 0.5}
    assert _residual(big, registry).valid(10 ** 400, big) is False  # raises in float arithmetic: the validator's False
