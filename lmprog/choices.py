"""How `select` picks among choices from their token logprobs.

Each method receives, per choice, the list of `(logprob, token_id, text)` entries
scored over that choice (entries whose logprob is `None` are already dropped by the
backend, and are dropped again here for safety), and returns a `ChoicesDecision`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence


@dataclass
class ChoicesDecision:
    decision: str
    meta_info: Optional[Dict[str, Any]] = None


def _values(entries) -> List[float]:
    return [float(e[0]) for e in entries if e[0] is not None]


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else -math.inf


def _argmax(scores: Sequence[float]) -> int:
    """First index of the maximum (ties go to the earlier choice)."""
    best = 0
    for i, score in enumerate(scores):
        if score > scores[best]:
            best = i
    return best


class ChoicesSamplingMethod:
    """Contract: `__call__(*, choices, normalized_prompt_logprobs, input_token_logprobs,
    output_token_logprobs, unconditional_token_logprobs=None) -> ChoicesDecision`."""

    @property
    def requires_unconditional_logprobs(self) -> bool:
        return False

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs,
                 output_token_logprobs, unconditional_token_logprobs=None) -> ChoicesDecision:
        raise NotImplementedError

    def __repr__(self):
        return type(self).__name__


class TokenLengthNormalized(ChoicesSamplingMethod):
    """The choice with the highest mean token logprob."""

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs,
                 output_token_logprobs, unconditional_token_logprobs=None) -> ChoicesDecision:
        best = _argmax(normalized_prompt_logprobs)
        return ChoicesDecision(choices[best], {
            "normalized_prompt_logprobs": normalized_prompt_logprobs,
            "input_token_logprobs": input_token_logprobs,
            "output_token_logprobs": output_token_logprobs,
        })


class GreedyTokenSelection(ChoicesSamplingMethod):
    """Walk the tokens left to right, keeping the choices whose logprob equals the column maximum.

    Shorter choices are padded with their own mean logprob, so a short choice neither
    wins nor loses just by ending early.
    """

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs,
                 output_token_logprobs, unconditional_token_logprobs=None) -> ChoicesDecision:
        rows = [_values(entries) for entries in input_token_logprobs]
        width = max((len(r) for r in rows), default=0)
        matrix = [r + [_mean(r)] * (width - len(r)) for r in rows]
        remaining = list(range(len(choices)))
        for col in range(width):
            best = max(matrix[i][col] for i in remaining)
            remaining = [i for i in remaining if matrix[i][col] == best]
            if len(remaining) == 1:
                break
        return ChoicesDecision(choices[remaining[0]], {
            "normalized_prompt_logprobs": normalized_prompt_logprobs,
            "input_token_logprobs": input_token_logprobs,
            "output_token_logprobs": output_token_logprobs,
            "greedy_logprob_matrix": matrix,
        })


class UnconditionalLikelihoodNormalized(ChoicesSamplingMethod):
    """Mean of (conditional - unconditional) token logprobs: how much the context raised each choice."""

    @property
    def requires_unconditional_logprobs(self) -> bool:
        return True

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs,
                 output_token_logprobs, unconditional_token_logprobs=None) -> ChoicesDecision:
        if unconditional_token_logprobs is None:
            raise ValueError("unconditional_likelihood_normalized needs unconditional_token_logprobs; "
                             "the backend did not provide them.")
        scores = []
        for cond, uncond in zip(input_token_logprobs, unconditional_token_logprobs):
            c = _values(cond)
            u = [0.0 if e[0] is None else float(e[0]) for e in uncond][-len(c):] if c else []
            u = [0.0] * (len(c) - len(u)) + u
            scores.append(_mean([a - b for a, b in zip(c, u)]))
        best = _argmax(scores)
        return ChoicesDecision(choices[best], {
            "normalized_prompt_logprobs": normalized_prompt_logprobs,
            "input_token_logprobs": input_token_logprobs,
            "output_token_logprobs": output_token_logprobs,
            "unconditional_token_logprobs": unconditional_token_logprobs,
            "normalized_unconditional_prompt_logprobs": scores,
        })


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()
