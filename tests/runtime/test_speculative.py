"""Speculative decoding through the Engine on the tiny model: greedy outputs are
token-identical to plain decoding (many prompts, radix cache on and off, page size 16,
stops, max_new_tokens cut-offs, logprobs, regex / JSON-schema constraints, streaming),
drafts are actually accepted, and the KV audit holds on both pools.

Prompts are repetitive so that n-gram drafts (from the prompt and from the tiny model's
own looping output) are accepted; the tests assert that some were."""

import json

import pytest

from engine_helpers import make_engine

PROMPTS = [
    "The cat sat on the mat. The cat sat on the mat. The cat sat on the",
    "1 2 3 4 5 6 7 8 1 2 3 4 5 6 7 8 1 2 3",
    "def f(x):\n    return x\n\ndef f(x):\n    return x\n\ndef f(",
    "red green blue red green blue red green",
    "The capital of France is",
    "Once upon a time, in a land far away,",
    "List three colors:",
    "abc abc abc abc abc abc abc",
]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
GREEDY = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
BASE = dict(max_total_tokens=8192)


def _cases():
    """(name, prompts, sampling params, generate kwargs)."""
    return [
        ("long", PROMPTS, GREEDY, {}),
        ("single", PROMPTS[:2], {"temperature": 0, "max_new_tokens": 64, "ignore_eos": True}, {}),
        ("max_new_tokens", PROMPTS, {"temperature": 0, "max_new_tokens": 3, "ignore_eos": True}, {}),
        ("max_new_tokens_odd", PROMPTS, {"temperature": 0, "max_new_tokens": 17}, {}),
        ("stop_str", PROMPTS, {"temperature": 0, "max_new_tokens": 48, "stop": [" the", "\n\n", "3"]}, {}),
        ("stop_regex", PROMPTS, {"temperature": 0, "max_new_tokens": 48, "stop_regex": [r"[0-9]{2}"]}, {}),
        ("stop_token", PROMPTS, {"temperature": 0, "max_new_tokens": 48, "stop_token_ids": [253, 28]}, {}),
        ("logprobs", PROMPTS[:4], {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True},
         {"return_logprob": True, "top_logprobs_num": 3}),
        ("min_new_tokens", PROMPTS[:4], {"temperature": 0, "max_new_tokens": 24, "min_new_tokens": 6}, {}),
        ("regex", PROMPTS[:4], {"temperature": 0, "max_new_tokens": 40,
                                "regex": r"(cat|dog|red)( (cat|dog|red|mat)){2,6}\."}, {}),
        ("json", ["A person as JSON: " + json.dumps({"name": "Ann", "age": 3}) * 3 + " Again: "],
         {"temperature": 0, "max_new_tokens": 64, "json_schema": json.dumps(SCHEMA)}, {}),
    ]


def _run(engine, prompts, params, kwargs):
    outs = engine.generate(prompts, params, **kwargs)
    return outs if isinstance(outs, list) else [outs]


def _summary(out, logprobs: bool):
    s = {"text": out["text"], "ids": out["output_ids"], "finish": out["meta_info"]["finish_reason"]}
    if logprobs:
        s["lp_ids"] = [e[1] for e in out["meta_info"]["output_token_logprobs"]]
        s["top_ids"] = [[e[1] for e in row] for row in out["meta_info"]["output_top_logprobs"]]
    return s


@pytest.fixture(scope="module")
def plain(tiny_model_path):
    """Reference outputs of every case, without speculation."""
    eng = make_engine(tiny_model_path, **BASE)
    ref = {name: _run(eng, p, sp, kw) for name, p, sp, kw in _cases()}
    eng.check_integrity()
    eng.shutdown()
    return ref


SPEC_CONFIGS = {
    "cache": dict(BASE),
    "nocache": dict(BASE, disable_radix_cache=True),
    "page16": dict(BASE, page_size=16),
    "short_drafts": dict(BASE, speculative_num_draft_tokens=3),
    "tree": dict(BASE, speculative_eagle_topk=3, speculative_num_draft_tokens=10),
    "tree_page16_nocache": dict(BASE, speculative_eagle_topk=2, speculative_num_draft_tokens=8, page_size=16,
                                disable_radix_cache=True),
}


@pytest.fixture(scope="module", params=list(SPEC_CONFIGS))
def spec_engine(request, tiny_model_path):
    eng = make_engine(tiny_model_path, speculative_algorithm="NGRAM", speculative_disable_cost_rule=True, **SPEC_CONFIGS[request.param])
    yield eng
    eng.check_integrity()
    eng.shutdown()


def _compare(ref_outs, outs, logprobs: bool):
    for ref, out in zip(ref_outs, outs):
        assert _summary(out, logprobs) == _summary(ref, logprobs)
        if logprobs:
            for a, b in zip(ref["meta_info"]["output_token_logprobs"], out["meta_info"]["output_token_logprobs"]):
                assert abs(a[0] - b[0]) < 1e-4, (a, b)


def test_greedy_identical_to_plain_decoding(plain, spec_engine):
    for name, prompts, params, kwargs in _cases():
        outs = _run(spec_engine, prompts, params, kwargs)
        _compare(plain[name], outs, bool(kwargs.get("return_logprob")))
    spec_engine.check_integrity()
    state = spec_engine.get_internal_state()
    assert state["spec_num_verify"] > 0 and state["spec_num_accepted_tokens"] > 0, state
    assert state["avg_spec_accept_length"] > 1.0


def test_cost_rule_on_stays_identical_and_measures(plain, tiny_model_path):
    """The cost rule on (the default): whatever timing makes it decide, greedy outputs are the
    plain ones and the audit holds; a batch size runs plain until its step time is measured
    (calibrating) and the requests that do not verify get shadow drafts, both independent
    of timing (how many drafts verify is not: on a loaded machine it may be none)."""
    eng = make_engine(tiny_model_path, speculative_algorithm="NGRAM", **BASE)
    try:
        for name, prompts, params, kwargs in _cases():
            if name in ("long", "stop_str", "logprobs", "json"):
                _compare(plain[name], _run(eng, prompts, params, kwargs), bool(kwargs.get("return_logprob")))
        eng.check_integrity()
        state = eng.get_internal_state()
        assert state["spec_num_steps_calibrating"] > 0, state
        assert state["spec_num_shadow_drafts"] > 0 and state["spec_num_shadow_accepted"] >= 0, state
    finally:
        eng.shutdown()


def test_one_at_a_time_and_streamed(plain, spec_engine):
    for i, prompt in enumerate(PROMPTS[:3]):
        out = spec_engine.generate(prompt, GREEDY)
        assert out["output_ids"] == plain["long"][i]["output_ids"]
        meta = out["meta_info"]
        assert meta["spec_verify_ct"] >= 1 and meta["spec_accept_length"] >= 1.0, meta
        assert 0.0 <= meta["spec_accept_rate"] <= 1.0
        chunks = list(spec_engine.generate(prompt, GREEDY, stream=True))
        assert chunks[-1]["output_ids"] == plain["long"][i]["output_ids"]
        assert chunks[-1]["text"] == plain["long"][i]["text"]


def test_constrained_drafts_stay_in_the_grammar(spec_engine):
    """Sampling (and greedy) under a regex: every output matches, drafts or not."""
    import re
    regex = r"(cat|dog|red)( (cat|dog|red|mat)){2,6}\."
    for temperature in (0.0, 1.0):
        outs = spec_engine.generate(PROMPTS, {"temperature": temperature, "max_new_tokens": 40,
                                              "regex": regex, "sampling_seed": 7})
        for out in outs:
            assert re.fullmatch(regex, out["text"]), out["text"]


def test_abort_during_speculation_keeps_the_audit(spec_engine):
    import threading
    params = {"temperature": 0, "max_new_tokens": 900, "ignore_eos": True}
    timer = threading.Timer(0.3, lambda: spec_engine.abort(abort_all=True))
    timer.start()
    outs = spec_engine.generate(PROMPTS, params)
    timer.join()
    kinds = [o["meta_info"]["finish_reason"]["type"] for o in outs]
    assert set(kinds) <= {"abort", "length"} and "abort" in kinds, kinds
    spec_engine.check_integrity()


@pytest.mark.parametrize("topk, pool", [(1, 300), (3, 260)])
def test_small_pool_retracts_and_stays_identical(tiny_model_path, topk, pool):
    """A pool too small for the batch: retraction and draft room both bite (chains, trees;
    trees accept more and finish sooner, so their pool is smaller)."""
    params = {"temperature": 0, "max_new_tokens": 48, "ignore_eos": True}
    small = dict(max_total_tokens=pool, chunked_prefill_size=64, schedule_conservativeness=0.05)
    ref_eng = make_engine(tiny_model_path, **small)
    ref = ref_eng.generate(PROMPTS, params)
    ref_eng.shutdown()
    eng = make_engine(tiny_model_path, speculative_algorithm="NGRAM", speculative_eagle_topk=topk, speculative_disable_cost_rule=True, **small)
    try:
        outs = eng.generate(PROMPTS, params)
        assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in ref]
        eng.check_integrity()
        state = eng.get_internal_state()
        assert state["num_retractions"] > 0 and state["spec_num_accepted_tokens"] > 0, state
    finally:
        eng.shutdown()


def test_metrics_report_speculation(spec_engine):
    from lmprog_runtime.server.metrics import ServerMetrics
    spec_engine.generate(PROMPTS[0], GREEDY)
    state = spec_engine.get_internal_state()
    text = ServerMetrics("tiny").render(state).decode()
    assert "sglang:spec_accept_length{" in text
    assert "sglang:spec_accepted_tokens_total{" in text
    assert state["spec_num_draft_tokens"] >= state["spec_num_accepted_tokens"] > 0


@pytest.mark.parametrize("topk", [1, 3])
def test_radix_cache_holds_only_verified_tokens(tiny_model_path, topk):
    """Every path of the tree, after speculative runs, spells a prefix of a finished request's
    prompt + output: no rejected (or accepted-but-unsent) draft ever reached it (chains, trees)."""
    eng = make_engine(tiny_model_path, speculative_algorithm="NGRAM", speculative_eagle_topk=topk, speculative_disable_cost_rule=True, **BASE)
    try:
        outs = eng.generate(PROMPTS, {"temperature": 0, "max_new_tokens": 40, "stop": ["3"]},
                            return_prompt_token_ids=True)
        eng.check_integrity()
        assert eng.get_internal_state()["spec_num_draft_tokens"] > eng.get_internal_state()[
            "spec_num_accepted_tokens"] > 0  # some drafts were rejected, some accepted
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
