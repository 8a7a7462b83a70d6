"""JSONSchemaBench dev sample: every schema compiles or is refused naming a feature;
compiled regexes accept the valid instances and reject the invalid ones."""
import json
import pathlib
import re

import pytest

from lmprog_runtime.constrained.json_schema import UnsupportedSchemaError, build_regex_from_schema

CORPUS = pathlib.Path(__file__).resolve().parents[1] / "data" / "jsonschemabench-dev"
FILES = sorted(CORPUS.glob("*.json"))
FEATURE = re.compile(r"keyword|pattern|format|allOf|anyOf|oneOf|\$ref|minProperties|maxProperties|"
                     r"propertyNames|dependencies|no instance|number bound|patternProperties")


def compact(v):
    return json.dumps(v, ensure_ascii=False, separators=(",", ":"))


def run_corpus(files=None):
    stats = {"compiled": 0, "refused": 0, "valid": 0, "valid_ok": 0, "invalid": 0, "invalid_ok": 0}
    wrongly_accepted = []
    for path in FILES if files is None else files:
        case = json.loads(path.read_text())
        try:
            rx = re.compile(build_regex_from_schema(case["schema"]))
        except UnsupportedSchemaError as exc:
            assert FEATURE.search(str(exc)), f"{path.name}: refusal must name the feature: {exc}"
            stats["refused"] += 1
            continue
        stats["compiled"] += 1
        for t in case["tests"]:
            hit = bool(rx.fullmatch(compact(t["data"])))
            key = "valid" if t["valid"] else "invalid"
            stats[key] += 1
            stats[key + "_ok"] += hit if t["valid"] else not hit
            if hit and not t["valid"]:
                wrongly_accepted.append(path.name)
    return stats, wrongly_accepted


@pytest.mark.skipif(not FILES, reason="corpus missing")
def test_corpus_sample_regex_level():
    """Every 8th schema (~9 s of the whole corpus's ~90 s): compiled or refused naming the
    feature, and no invalid instance accepted; the coverage ratios are the whole corpus's below."""
    sample = FILES[::8]
    stats, wrong = run_corpus(sample)
    assert stats["compiled"] + stats["refused"] == len(sample)
    assert stats["compiled"] / len(sample) >= 0.95, stats
    assert not wrong, f"invalid instances accepted: {wrong}"


@pytest.mark.slow
@pytest.mark.skipif(not FILES, reason="corpus missing")
def test_corpus_regex_level():
    stats, wrong = run_corpus()
    n = len(FILES)
    assert stats["compiled"] + stats["refused"] == n
    assert stats["compiled"] / n >= 0.95, stats
    assert not wrong, f"invalid instances accepted: {wrong}"
    # misses are documented narrowings (key order)
    assert stats["valid_ok"] / stats["valid"] >= 0.99, stats
