"""Constrained decoding through the Engine: outputs always satisfy their constraint (greedy
and random sampling, jump-forward on and off), batch composition does not change them,
and bad constraints are a 400 that names the problem."""

import json
import re

import jsonschema
import pytest

from engine_helpers import make_engine
from lmprog_runtime.generate_request import RequestError

IPV4 = r"((25[0-5]|2[0-4]\d|[01]?\d\d?)\.){3}(25[0-5]|2[0-4]\d|[01]?\d\d?)"
DATE = r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2},
    },
    "required": ["name", "age", "color"],
    "additionalProperties": False,
}
PROMPTS = ["Give me an answer: ", "Q: what is it?\nA: ", "JSON please: ", "Output:"]


@pytest.fixture(scope="module", params=[False, True], ids=["jump-forward", "no-jump-forward"])
def engine(request, tiny_model_path):
    eng = make_engine(tiny_model_path, max_total_tokens=8192, disable_jump_forward=request.param,
                      constrained_json_whitespace_pattern=r"[ \n]?")
    yield eng
    eng.check_integrity()
    eng.shutdown()


def _check_regex(text, regex):
    assert re.fullmatch(regex, text), repr(text)


def _check_json(text):
    jsonschema.validate(json.loads(text), PERSON)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_regex_outputs_match(engine, temperature):
    for regex in (IPV4, DATE, r"(yes|no|maybe)", r"[a-z]{3,8}@example\.com"):
        params = {"regex": regex, "temperature": temperature, "max_new_tokens": 48, "sampling_seed": 3}
        outs = engine.generate(PROMPTS, params)
        for out in outs:
            assert out["meta_info"]["finish_reason"]["type"] == "stop", out
            _check_regex(out["text"], regex)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_outputs_validate(engine, temperature):
    params = {"json_schema": json.dumps(PERSON), "temperature": temperature, "max_new_tokens": 160,
              "sampling_seed": 5}
    for out in engine.generate(PROMPTS, params):
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        _check_json(out["text"])


def test_same_output_alone_or_in_a_mixed_batch(engine):
    constrained = {"regex": DATE, "temperature": 0, "max_new_tokens": 32}
    plain = {"temperature": 0, "max_new_tokens": 20}
    alone = engine.generate(PROMPTS[0], constrained)
    batch = engine.generate(PROMPTS * 2, [plain, constrained, plain, plain, plain, constrained, plain, plain])
    assert batch[1]["output_ids"] == batch[5]["output_ids"] == engine.generate(PROMPTS[1], constrained)["output_ids"]
    assert engine.generate([PROMPTS[0], PROMPTS[2]], [constrained, plain])[0]["output_ids"] == alone["output_ids"]
    assert batch[0]["output_ids"] == engine.generate(PROMPTS[0], plain)["output_ids"]


def test_constraint_with_stop_and_max_tokens(engine):
    out = engine.generate(PROMPTS[0], {"regex": r"[a-z ]{20,40}", "temperature": 0, "max_new_tokens": 5})
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    assert re.fullmatch(r"[a-z ]*", out["text"])


def test_streaming_constrained(engine):
    chunks = list(engine.generate(PROMPTS[1], {"regex": IPV4, "temperature": 0, "max_new_tokens": 32},
                                  stream=True))
    _check_regex(chunks[-1]["text"], IPV4)


@pytest.mark.parametrize("params, fragment", [
    ({"regex": "(unclosed"}, "Failed to compile regex grammar"),
    ({"json_schema": "{not json"}, "Failed to compile json grammar"),
    ({"json_schema": json.dumps({"type": "string", "pattern": "(?=a)b"})}, "lookaround"),  # cfg refuses these
    ({"ebnf": 'root ::= "unclosed'}, "Failed to compile ebnf grammar"),  # EBNF itself: test_ebnf.py
])
def test_bad_constraints_are_400(engine, params, fragment):
    with pytest.raises(RequestError) as e:
        engine.generate(PROMPTS[0], {**params, "max_new_tokens": 8})
    assert e.value.status == 400 and fragment in str(e.value)
    assert engine.generate(PROMPTS[0], {"max_new_tokens": 2})["meta_info"]["completion_tokens"] == 2


def test_jump_forward_saves_steps(tiny_model_path):
    """A schema with long forced keys needs fewer decode steps with jump-forward."""
    params = {"json_schema": json.dumps(PERSON), "temperature": 0, "max_new_tokens": 160}
    steps = {}
    for jf in (True, False):
        with make_engine(tiny_model_path, max_total_tokens=4096, disable_jump_forward=not jf,
                         constrained_json_whitespace_pattern="") as eng:
            eng.generate(PROMPTS[0], {**params, "max_new_tokens": 1})  # compile once, untimed
            before = eng.get_internal_state()["num_steps"]
            out = eng.generate(PROMPTS[2], params)
            _check_json(out["text"])
            steps[jf] = eng.get_internal_state()["num_steps"] - before
            eng.check_integrity()
    assert steps[True] < steps[False], steps
