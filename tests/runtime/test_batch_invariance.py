"""Batch invariance on the real SmolLM2 (fp32): 16 mixed-length greedy requests submitted
together give the same tokens as one at a time. A divergence is accepted only at a
near-tie: where the sequential run's top two logprobs differ by less than 1e-4."""

import pytest

from engine_helpers import make_engine

pytestmark = pytest.mark.slow  # the real SmolLM2, 16 requests: `pytest -m slow`

NEAR_TIE = 1e-4
PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def add(a, b):",
    "List three primary colors:",
    "Once upon a time, in a small village by the mountains, there lived an old clockmaker who",
    "Translate to French: good morning",
    "2 + 2 =",
    "The three laws of thermodynamics are",
    "Q: Why is the sky blue?\nA:",
    "import numpy as np\n\n# compute the mean of an array\n",
    "My favorite food is",
    "In 1969, the first humans",
    "A short story about a robot who learns to paint. Chapter 1.",
    "The quick brown fox",
    "Explain photosynthesis in one sentence:",
    "Rome was not built in a day, and neither was",
]


@pytest.fixture(scope="module")
def smollm2_engine():
    engine = make_engine("default", dtype="float32", max_total_tokens=16384)
    yield engine
    engine.shutdown()


def test_batch_matches_sequential(smollm2_engine):
    params = {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}
    sequential = [smollm2_engine.generate(p, params, return_logprob=True, top_logprobs_num=2) for p in PROMPTS]
    batched = smollm2_engine.generate(PROMPTS, params)
    for seq, bat in zip(sequential, batched):
        a, b = seq["output_ids"], bat["output_ids"]
        if a == b:
            continue
        first = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
        top = seq["meta_info"]["output_top_logprobs"][first]
        margin = top[0][0] - top[1][0]
        assert margin < NEAR_TIE, f"divergence at token {first} with margin {margin:.2e}"
    smollm2_engine.check_integrity()
