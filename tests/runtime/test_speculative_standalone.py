"""STANDALONE speculative decoding (a draft model with its own runner, KV pool and radix
cache) on tiny random-weight models — plumbing, not speed: with the target itself as the
draft nearly every draft is accepted, with a differently seeded tiny model few are; both
must give the plain greedy outputs, and both pools must pass the audit.

Also the sampling test: with temperature > 0 the distribution of the first tokens over
many seeds equals plain sampling's (two-sample chi-square per position, alpha = 1e-3)."""

import math

import pytest

from engine_helpers import make_engine

PROMPTS = [
    "The cat sat on the mat. The cat sat on the",
    "1 2 3 4 5 6 7 8 1 2 3",
    "The capital of France is",
    "Once upon a time, in a land far away,",
]
GREEDY = {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}
BASE = dict(max_total_tokens=4096)


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory):
    from tiny_model import make_tiny_llama
    return make_tiny_llama(tmp_path_factory.mktemp("tiny_draft"), seed=1)


@pytest.fixture(scope="module")
def plain(tiny_model_path):
    eng = make_engine(tiny_model_path, **BASE)
    yield eng
    eng.shutdown()


def _standalone(target, draft, **kw):
    return make_engine(target, speculative_algorithm="STANDALONE", speculative_disable_cost_rule=True, speculative_draft_model_path=draft,
                       speculative_num_steps=4, **BASE, **kw)


@pytest.mark.parametrize("which", ["self", "other"])
@pytest.mark.parametrize("cache", [True, False])
def test_standalone_greedy_identical(plain, tiny_model_path, other_draft, which, cache):
    ref = plain.generate(PROMPTS, GREEDY)
    draft = tiny_model_path if which == "self" else other_draft
    eng = _standalone(tiny_model_path, draft, disable_radix_cache=not cache)
    try:
        outs = eng.generate(PROMPTS, GREEDY)
        assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in ref]
        one = eng.generate(PROMPTS[0], {**GREEDY, "stop": [" the"]})
        assert one["output_ids"] == plain.generate(PROMPTS[0], {**GREEDY, "stop": [" the"]})["output_ids"]
        eng.check_integrity()  # the target's pool and the draft model's
        state = eng.get_internal_state()
        assert state["spec_num_verify"] > 0
        if which == "self":  # the target drafting for itself: (nearly) everything is accepted
            assert state["spec_num_accepted_tokens"] >= 0.9 * state["spec_num_draft_tokens"], state
    finally:
        eng.shutdown()


def _chi2_critical(df: int, z: float = 3.09) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z = 3.09: alpha 1e-3)."""
    a = 2.0 / (9 * df)
    return df * (1 - a + z * math.sqrt(a)) ** 3


def _two_sample_chi2(a: dict, b: dict, min_count: int = 10):
    """Tokens seen fewer than `min_count` times in both runs together are pooled into one
    cell (the chi-square approximation needs expected counts of about 5 or more)."""
    pooled_a, pooled_b = {}, {}
    for k in set(a) | set(b):
        small = a.get(k, 0) + b.get(k, 0) < min_count
        pooled_a[-1 if small else k] = pooled_a.get(-1 if small else k, 0) + a.get(k, 0)
        pooled_b[-1 if small else k] = pooled_b.get(-1 if small else k, 0) + b.get(k, 0)
    a, b = pooled_a, pooled_b
    keys = sorted(set(a) | set(b))
    na, nb = sum(a.values()), sum(b.values())
    stat = 0.0
    for k in keys:
        x, y = a.get(k, 0), b.get(k, 0)
        ex, ey = (x + y) * na / (na + nb), (x + y) * nb / (na + nb)
        stat += (x - ex) ** 2 / ex + (y - ey) ** 2 / ey
    return stat, max(len(keys) - 1, 1)


def assert_same_token_distributions(ref: list, outs: list, positions: int) -> None:
    """At each of the first `positions` output positions, the tokens of the `outs` samples
    and of the `ref` samples pass a two-sample chi-square test (alpha 1e-3)."""
    for pos in range(positions):
        a, b = {}, {}
        for o in ref:
            a[o["output_ids"][pos]] = a.get(o["output_ids"][pos], 0) + 1
        for o in outs:
            b[o["output_ids"][pos]] = b.get(o["output_ids"][pos], 0) + 1
        stat, df = _two_sample_chi2(a, b)
        assert stat < _chi2_critical(df), (pos, stat, df, a, b)


def test_sampling_matches_plain_distribution(plain, tiny_model_path):
    """N seeded requests, temperature 1 with top_k 3 (a few outcomes per position), with
    and without speculation (the target drafting for itself, so drafts are accepted with
    probability p(draft)). For each of the first 4 output positions the token counts of
    the two runs must pass a two-sample chi-square test at alpha = 1e-3."""
    n, positions = 400, 4
    params = [{"temperature": 1.0, "top_k": 3, "max_new_tokens": positions, "ignore_eos": True,
               "sampling_seed": i} for i in range(n)]
    prompt = [PROMPTS[0]] * n
    ref = plain.generate(prompt, params)
    eng = _standalone(tiny_model_path, tiny_model_path)
    try:
        outs = eng.generate(prompt, params)
        state = eng.get_internal_state()
        eng.check_integrity()
    finally:
        eng.shutdown()
    # speculation really happened (the CPU's per-step draft cap lets ~24 of the 256 running
    # requests draft in one step, so far from every position is drafted)
    assert state["spec_num_accepted_tokens"] >= n // 4, state
    assert_same_token_distributions(ref, outs, positions)
