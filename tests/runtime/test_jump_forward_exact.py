"""Jump-forward is exact: greedy outputs (token ids, text, finish reasons, logprobs) with
jump-forward on equal those with it off, on a fixed set of JSON schemas and regexes —
the issue's two examples (`{"name": "John"` and `because the`), keys with spaces and
unicode, numbers, enums, nested objects, compact and flexible whitespace — on the tiny
model in every loop (plain, overlap, speculative decoding, llguidance) and on the real
SmolLM2 (`slow`). The forced text must actually be drafted and (in part) accepted, so
the comparison cannot pass with jump-forward silently off."""

import json

import pytest

from engine_helpers import make_engine

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
KEYS = {"type": "object", "properties": {"first name": {"type": "string", "maxLength": 10},
                                         "ville préférée": {"type": "string", "maxLength": 10},
                                         "note ★": {"type": "number"}},
        "required": ["first name", "ville préférée", "note ★"], "additionalProperties": False}
NESTED = {"type": "object", "properties": {
    "id": {"type": "integer"},
    "color": {"enum": ["red", "green", "blue", "dark purple"]},
    "owner": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                               "verified": {"type": "boolean"}},
              "required": ["city", "verified"], "additionalProperties": False},
    "tags": {"type": "array", "items": {"enum": ["alpha", "beta"]}, "maxItems": 3}},
    "required": ["id", "color", "owner", "tags"], "additionalProperties": False}
REGEXES = [
    r"(Yes|No), because the [a-z ]{1,30}\.",
    r"(Yes|No), because [a-z ]{1,30}\.",          # forced text ending in a space
    r"The answer is (Paris|London|Lisbon)\. Population: [0-9]{1,7} people\.",
    r"[a-z]{1,8}@example\.(com|org)",
]
PROMPTS = ["A person as JSON:", "Answer in JSON.\n", "Is the sky blue?", "Q: capital of France?\nA:"]


def _cases():
    """(name, prompts, sampling params, generate kwargs)."""
    g = {"temperature": 0, "max_new_tokens": 64}
    cases = [(f"json_{n}", PROMPTS, {**g, "json_schema": json.dumps(s)}, {})
             for n, s in (("person", PERSON), ("keys", KEYS), ("nested", NESTED))]
    cases += [(f"regex_{i}", PROMPTS, {**g, "regex": rx}, {}) for i, rx in enumerate(REGEXES)]
    cases += [("logprobs", PROMPTS[:2], {**g, "json_schema": json.dumps(PERSON)},
               {"return_logprob": True, "top_logprobs_num": 2}),
              ("min_new_tokens", PROMPTS[:2], {**g, "regex": REGEXES[0], "min_new_tokens": 20}, {}),
              ("penalties", PROMPTS, {**g, "json_schema": json.dumps(NESTED), "frequency_penalty": 0.8,
                                      "presence_penalty": 0.3, "repetition_penalty": 1.3}, {}),
              ("penalties_lp", PROMPTS[:2], {**g, "regex": REGEXES[2], "repetition_penalty": 1.5,
                                             "min_new_tokens": 12}, {"return_logprob": True}),
              ("short", PROMPTS, {**g, "json_schema": json.dumps(NESTED), "max_new_tokens": 9}, {}),
              ("stop", PROMPTS, {**g, "regex": REGEXES[2], "stop": [" Pop"]}, {})]
    return cases


def _summary(out, logprobs: bool):
    s = {"text": out["text"], "ids": out["output_ids"], "finish": out["meta_info"]["finish_reason"]}
    if logprobs:
        s["lp"] = [(round(e[0], 3), e[1]) for e in out["meta_info"]["output_token_logprobs"]]
        s["top"] = [[e[1] for e in row] for row in out["meta_info"].get("output_top_logprobs") or []]
    return s


def _run_all(eng):
    got = {}
    for name, prompts, params, kwargs in _cases():
        outs = eng.generate(prompts, params, **kwargs)
        got[name] = [_summary(o, bool(kwargs)) for o in (outs if isinstance(outs, list) else [outs])]
    eng.check_integrity()
    return got, eng.get_internal_state()


def _compare(ref: dict, got: dict) -> None:
    for name in ref:
        for a, b in zip(ref[name], got[name]):
            assert b == a, f"{name}: jump-forward changed the output"


@pytest.fixture(scope="module")
def reference(tiny_model_path):
    """Every case with jump-forward off: the outputs to match."""
    eng = make_engine(tiny_model_path, max_total_tokens=8192, disable_jump_forward=True,
                      constrained_json_whitespace_pattern="[ ]?")
    try:
        return _run_all(eng)[0]
    finally:
        eng.shutdown()


CONFIGS = {
    "plain": dict(),
    "overlap": dict(force_overlap_schedule=True),
    "page16_nocache": dict(page_size=16, disable_radix_cache=True),
    "speculative": dict(speculative_algorithm="NGRAM"),
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_greedy_outputs_equal_jump_forward_off(tiny_model_path, reference, config):
    eng = make_engine(tiny_model_path, max_total_tokens=8192, constrained_json_whitespace_pattern="[ ]?",
                      **CONFIGS[config])
    try:
        got, state = _run_all(eng)
    finally:
        eng.shutdown()
    _compare(reference, got)
    assert state["num_jump_forward_drafted"] > 0 and state["num_jump_forward_tokens"] > 0, state


def test_compact_whitespace_and_default_whitespace(tiny_model_path):
    """The compact pattern forces `":"` runs; the default flexible one forces only `{`."""
    for ws in ("", None):
        outs = {}
        for jf in (True, False):
            kw = {} if ws is None else {"constrained_json_whitespace_pattern": ws}
            with make_engine(tiny_model_path, max_total_tokens=4096, disable_jump_forward=not jf, **kw) as eng:
                res = eng.generate(PROMPTS, {"temperature": 0, "max_new_tokens": 64,
                                             "json_schema": json.dumps(NESTED)})
                outs[jf] = [_summary(o, False) for o in res]
                eng.check_integrity()
        assert outs[True] == outs[False], ws


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_other_backends_exact(tiny_model_path, backend):
    """The adapters behind the same contract: their own forced strings, the same drafts."""
    pytest.importorskip(backend)
    outs, states = {}, {}
    for jf in (True, False):
        with make_engine(tiny_model_path, max_total_tokens=4096, grammar_backend=backend,
                         disable_jump_forward=not jf) as eng:
            res = []
            for name, prompts, params, kwargs in _cases()[:7]:
                res.append([_summary(o, False) for o in eng.generate(prompts, params)])
            outs[jf], states[jf] = res, eng.get_internal_state()
            eng.check_integrity()
    assert outs[True] == outs[False]
    assert states[True]["num_jump_forward_drafted"] > 0


@pytest.mark.slow
def test_smollm2_greedy_outputs_equal_and_steps_saved():
    """The real model: outputs identical, and forced tokens accepted save decode steps. (Many
    drafted tokens are rejected on these prompts, by design: the partial last token of a
    forced run — `"` where the model writes `":`, ` ` where it writes ` the` — and forced
    text the model would spell in smaller pieces.)"""
    res = {}
    for jf in (True, False):
        with make_engine("default", max_total_tokens=8192, disable_jump_forward=not jf,
                         constrained_json_whitespace_pattern="[ ]?") as eng:
            res[jf] = _run_all(eng)
    _compare(res[False][0], res[True][0])
    on, off = res[True][1], res[False][1]
    assert on["num_jump_forward_drafted"] > on["num_jump_forward_tokens"] > 0, on
    assert on["num_steps"] < off["num_steps"], (on["num_steps"], off["num_steps"])


def test_radix_cache_holds_only_accepted_tokens(tiny_model_path):
    """After constrained runs with forced drafts (some rejected), every path of the tree
    spells a prefix of a finished request's prompt + output: no rejected forced token,
    and no token that was later changed, reached it."""
    eng = make_engine(tiny_model_path, max_total_tokens=8192, constrained_json_whitespace_pattern="[ ]?")
    try:
        outs = []
        for name, prompts, params, kwargs in _cases()[:7]:
            outs += eng.generate(prompts, params, return_prompt_token_ids=True)
        eng.check_integrity()
        state = eng.get_internal_state()
        assert state["num_jump_forward_drafted"] > state["num_jump_forward_tokens"] > 0, state
        sequences = [tuple(o["prompt_token_ids"] + o["output_ids"]) for o in outs]
        tree = eng.scheduler.kv.tree
        leaves = [n for n in tree._nodes() if not n.children]
        assert leaves
        for leaf in leaves:
            path, node = [], leaf
            while node is not tree.root:
                path[:0] = list(node.key)
                node = node.parent
            assert any(seq[:len(path)] == tuple(path) for seq in sequences), path
    finally:
        eng.shutdown()

