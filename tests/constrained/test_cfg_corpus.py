"""The cfg engine on both public corpora at byte level (no tokenizer, so it is quick):
the real-world dev sample compiles and is exact; on JSON-Schema-Test-Suite draft 2020-12
(its remote schemas from the local registry) every group compiles, no invalid instance is
accepted, and the valid instances missed are the documented narrowings only."""
import json
import pathlib

import pytest

from lmprog_runtime.constrained import GrammarError
from lmprog_runtime.constrained.cfg.backend import accepts_text, compile_machine
from lmprog_runtime.constrained.cfg.registry import SchemaRegistry

DATA = pathlib.Path(__file__).resolve().parents[1] / "data"
DEV = sorted((DATA / "jsonschemabench-dev").glob("*.json"))
SUITE = sorted((DATA / "json-schema-test-suite" / "draft2020-12").glob("*.json"))
REMOTES = SchemaRegistry((("http://localhost:1234/", str(DATA / "json-schema-test-suite" / "remotes")),))


def compact(v):
    return json.dumps(v, ensure_ascii=False, separators=(",", ":"))


def run(cases, registry=None):
    wrong_accept, wrong_reject, refused = [], [], []
    for name, schema, tests in cases:
        try:
            m = compile_machine("json", json.dumps(schema), timeout_s=20, registry=registry)
        except GrammarError as exc:
            refused.append((name, str(exc)))
            continue
        for t in tests:
            ok = accepts_text(m, compact(t["data"]))
            if ok and not t["valid"]:
                wrong_accept.append((name, t["description"]))
            if not ok and t["valid"]:
                wrong_reject.append((name, t["description"]))
    return wrong_accept, wrong_reject, refused


@pytest.mark.skipif(not DEV, reason="corpus missing")
def test_dev_corpus_compiles_and_is_exact():
    cases = [(p.stem, c["schema"], c["tests"]) for p in DEV for c in (json.loads(p.read_text()),)]
    wrong_accept, wrong_reject, refused = run(cases)
    assert not refused and not wrong_accept and not wrong_reject, (refused, wrong_accept, wrong_reject)


@pytest.mark.skipif(not SUITE, reason="suite missing")
def test_json_schema_test_suite_never_accepts_invalid():
    cases = [(f"{p.stem}#{i}", g["schema"], g["tests"]) for p in SUITE for i, g in enumerate(json.loads(p.read_text()))]
    wrong_accept, wrong_reject, refused = run(cases, REMOTES)
    assert not wrong_accept, wrong_accept
    assert not refused, refused
    assert not wrong_reject, wrong_reject


# values of every kind, each decided by every suite schema as jsonschema decides it (a check
# kept only for the kinds it may refuse, Node.checked_kinds, must not let another kind through)
PROBES = ["", "abc", "a", "foo", 0, 1, -1, 1.5, 2, 100, True, False, None, [], [1], ["a"], [1, "a"], [1, 1],
          ["a", "a"], {}, {"a": 1}, {"foo": 1}, {"foo": "bar"}, {"bar": 2}, {"a": 1, "b": "x"}, {"foo": [1, 2]}]


@pytest.mark.skipif(not SUITE, reason="suite missing")
def test_suite_schemas_decide_values_of_every_kind_as_jsonschema_does():
    from jsonschema.validators import Draft202012Validator, validator_for
    mismatches, n = [], 0
    for p in SUITE:
        for i, group in enumerate(json.loads(p.read_text())):
            schema = group["schema"]
            m = compile_machine("json", json.dumps(schema), timeout_s=20, registry=REMOTES)
            validator = validator_for(schema, default=Draft202012Validator)(schema, registry=REMOTES.referencing())
            for value in PROBES:
                try:
                    want = validator.is_valid(value)
                except Exception:  # noqa: BLE001 - a pattern Python's re cannot read (ECMA \p{..}): not decided
                    continue
                n += 1
                if accepts_text(m, compact(value)) != want:
                    mismatches.append((f"{p.stem}#{i}", compact(value)))
    assert n > 9000 and not mismatches, mismatches
