"""Choice methods on SGLang's own mock data (and on data with the server's leading None)."""

import pytest

from lmprog.choices import greedy_token_selection, token_length_normalized, unconditional_likelihood_normalized

DATA = {
    "choices": ["organ", "organism", "antidisestablishmentarianism"],
    "normalized_prompt_logprobs": [-0.1, -0.2, -0.05],
    "input_token_logprobs": [
        [[-0.1, 1, None]],
        [[-0.1, 1, None], [-0.3, 2, None]],
        [[-0.4, 3, None], [-0.25, 4, None], [-0.1, 5, None], [-0.01, 6, None], [-0.01, 7, None],
         [-0.01, 8, None], [-0.01, 9, None], [-0.01, 2, None]],
    ],
    "output_token_logprobs": [[[-0.1, 10, None]]] * 3,
    "unconditional_token_logprobs": [
        [[None, 1, None]],
        [[None, 1, None], [-1.4, 2, None]],
        [[None, 3, None], [-0.25, 4, None], [-0.1, 5, None], [-0.01, 6, None], [-0.01, 7, None],
         [-0.01, 8, None], [-0.01, 9, None], [-0.01, 2, None]],
    ],
}


def test_token_length_normalized():
    assert token_length_normalized(**DATA).decision == "antidisestablishmentarianism"


def test_greedy_token_selection():
    decision = greedy_token_selection(**DATA)
    assert decision.decision == "organ"
    expected = [[-0.1] * 8, [-0.1, -0.3] + [-0.2] * 6, [-0.4, -0.25, -0.1] + [-0.01] * 5]
    for row, exp in zip(decision.meta_info["greedy_logprob_matrix"], expected):
        assert row == pytest.approx(exp, abs=0.01)


def test_unconditional_likelihood_normalized():
    decision = unconditional_likelihood_normalized(**DATA)
    assert decision.decision == "organism"
    assert decision.meta_info["normalized_unconditional_prompt_logprobs"] == pytest.approx([-0.1, 0.5, -0.05],
                                                                                           abs=0.01)


def test_leading_none_does_not_break_any_method():
    data = dict(DATA, input_token_logprobs=[[[None, 0, None]] + rows for rows in DATA["input_token_logprobs"]])
    assert greedy_token_selection(**data).decision == "organ"
    assert unconditional_likelihood_normalized(**data).decision == "organism"


def test_unconditional_requires_data():
    with pytest.raises(ValueError, match="unconditional_token_logprobs"):
        unconditional_likelihood_normalized(**dict(DATA, unconditional_token_logprobs=None))
    assert unconditional_likelihood_normalized.requires_unconditional_logprobs
    assert not token_length_normalized.requires_unconditional_logprobs
