"""The cfg grammar engine through the Engine (--grammar-backend cfg): outputs satisfy
their constraint, greedy and sampled, jump-forward on and off, and jump-forward saves
decode steps — the checks test_constrained_engine.py makes of the default backend."""

import json
import re

import jsonschema
import pytest

from engine_helpers import make_engine
from lmprog_runtime.tokenizer_manager import RequestError
from test_constrained_engine import DATE, IPV4, PERSON, PROMPTS

UNIQUE = {"type": "object", "properties": {"ids": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                              "maximum": 9},
                                                   "uniqueItems": True, "maxItems": 3},
                                           "kind": {"not": {"const": "x"}, "type": "string", "maxLength": 4}},
          "required": ["ids", "kind"], "additionalProperties": False}


@pytest.fixture(scope="module", params=[False, True], ids=["jump-forward", "no-jump-forward"])
def engine(request, tiny_model_path):
    eng = make_engine(tiny_model_path, max_total_tokens=8192, disable_jump_forward=request.param,
                      grammar_backend="cfg", constrained_json_whitespace_pattern=r"[ \n]?")
    yield eng
    eng.check_integrity()
    eng.shutdown()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_regex_outputs_match(engine, temperature):
    for regex in (IPV4, DATE, r"(yes|no|maybe)", r"[a-z]{3,8}@example\.com"):
        params = {"regex": regex, "temperature": temperature, "max_new_tokens": 48, "sampling_seed": 3}
        for out in engine.generate(PROMPTS, params):
            assert out["meta_info"]["finish_reason"]["type"] == "stop", out
            assert re.fullmatch(regex, out["text"]), out["text"]


@pytest.mark.parametrize("schema", [PERSON, UNIQUE], ids=["person", "semantic"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_outputs_validate(engine, temperature, schema):
    params = {"json_schema": json.dumps(schema), "temperature": temperature, "max_new_tokens": 160,
              "sampling_seed": 5}
    for out in engine.generate(PROMPTS, params):
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        jsonschema.validate(json.loads(out["text"]), schema)


def test_jump_forward_saves_steps(tiny_model_path):
    params = {"json_schema": json.dumps(PERSON), "temperature": 0, "max_new_tokens": 160}
    steps = {}
    for jf in (True, False):
        with make_engine(tiny_model_path, max_total_tokens=4096, disable_jump_forward=not jf, grammar_backend="cfg",
                         constrained_json_whitespace_pattern="") as eng:
            eng.generate(PROMPTS[0], {**params, "max_new_tokens": 1})
            before = eng.get_internal_state()["num_steps"]
            out = eng.generate(PROMPTS[2], params)
            jsonschema.validate(json.loads(out["text"]), PERSON)
            steps[jf] = eng.get_internal_state()["num_steps"] - before
            eng.check_integrity()
    assert steps[True] < steps[False], steps


def test_ebnf_through_cfg(engine):
    city = 'root ::= "The capital is " city "."\ncity ::= "Paris" | "Rome" | "Oslo"'
    for temperature in (0.0, 1.0):
        out = engine.generate("Answer:", {"ebnf": city, "max_new_tokens": 24, "temperature": temperature,
                                          "sampling_seed": 1})
        assert out["text"] in ("The capital is Paris.", "The capital is Rome.", "The capital is Oslo."), out
        assert out["meta_info"]["finish_reason"]["type"] == "stop"


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_dead_end_fails_the_request_not_the_batch(engine, temperature):
    """A prefix every completion of which fails a semantic check leaves no token: that request
    fails with the reason (never sampled from all -inf logits), its batch-mate finishes."""
    dead = {"json_schema": json.dumps({"const": True, "not": {"const": True}}), "max_new_tokens": 8,
            "temperature": temperature, "sampling_seed": 1}
    fine = {"regex": r"(yes|no)", "max_new_tokens": 8, "temperature": temperature, "sampling_seed": 1}
    with pytest.raises(RequestError, match="no token can continue") as err:
        engine.generate(PROMPTS[0], dead)
    assert err.value.status == 400  # the constraint's doing, not a server fault
    outs = engine.generate(PROMPTS[:2], fine)
    assert all(o["text"] in ("yes", "no") for o in outs), outs
