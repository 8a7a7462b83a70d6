"""Through the Engine with page_size 16: retraction under a short pool, and jump-forward
(which truncates KV mid-page), give the same greedy tokens as a roomy pool with page 1."""

import pytest

from engine_helpers import make_engine

PROMPTS = [f"Request number {i} asks for a long story about the sea and" for i in range(4)]
GREEDY = {"temperature": 0, "max_new_tokens": 60, "ignore_eos": True}
REGEX = {"temperature": 0, "max_new_tokens": 40,
         "regex": r'\{"name": "[a-z]{1,12}", "tags": \["[a-z]{1,6}", "[a-z]{1,6}"\]\}'}


@pytest.fixture(scope="module")
def reference(tiny_model_path):
    engine = make_engine(tiny_model_path, max_total_tokens=4096)
    try:
        yield (engine.generate(PROMPTS, GREEDY), engine.generate("Data:", REGEX))
    finally:
        engine.shutdown()


def test_retraction_with_pages(tiny_model_path, reference):
    engine = make_engine(tiny_model_path, max_total_tokens=256, page_size=16)
    try:
        outs = engine.generate(PROMPTS, GREEDY)
        assert sum(o["meta_info"]["num_retractions"] for o in outs) > 0
        assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in reference[0]]
        engine.check_integrity()
    finally:
        engine.shutdown()


def test_jump_forward_with_pages(tiny_model_path, reference):
    engine = make_engine(tiny_model_path, max_total_tokens=4096, page_size=16)
    try:
        out = engine.generate("Data:", REGEX)
        assert engine.get_internal_state()["num_jump_forward_tokens"] > 0
        assert out["output_ids"] == reference[1]["output_ids"]
        engine.check_integrity()
    finally:
        engine.shutdown()
