"""The RL hooks: swap weights in place, and free the model's memory between rollouts.

    engine.update_weights_from_disk(path, weight_version="step-1")  # idle only; flushes the cache
    engine.get_weight_version()                                     # also in every meta_info
    engine.release_memory_occupation()      # frees weights + KV; generation fails with 503
    engine.resume_memory_occupation()       # re-creates them (the current weights)

Over HTTP these are POST /update_weights_from_disk, /release_memory_occupation,
/resume_memory_occupation and GET /get_weight_version (tests/server/test_rl_hooks_http.py).
"""

import pytest

from engine_helpers import make_engine
from tiny_model import make_tiny_llama

PROMPT = "The capital of France is"
GREEDY = {"max_new_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def other_model(tmp_path_factory):
    """The tiny model's architecture with different weights."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny_llama_seed1"), seed=1)


@pytest.fixture
def engine(tiny_model_path):
    engine = make_engine(tiny_model_path, max_total_tokens=2048)
    yield engine
    engine.shutdown()


def ids(engine):
    return engine.generate(PROMPT, GREEDY)["output_ids"]


def test_update_changes_the_outputs_and_updating_back_restores_them(engine, tiny_model_path, other_model):
    before = ids(engine)
    reply = engine.update_weights_from_disk(other_model, weight_version="step-1")
    assert reply["success"] and reply["weight_version"] == "step-1"
    after = engine.generate(PROMPT, GREEDY)
    assert after["output_ids"] != before
    assert after["meta_info"]["weight_version"] == "step-1" == engine.get_model_info()["weight_version"]
    assert after["meta_info"]["cached_tokens"] == 0  # the cache held KV of the old weights: flushed
    assert engine.update_weights_from_disk(tiny_model_path)["weight_version"] == "2"  # updates so far
    assert ids(engine) == before
    engine.check_integrity()  # no KV slot leaked


def test_a_model_that_does_not_fit_is_refused_and_the_weights_stay(engine, tmp_path):
    before = ids(engine)
    wider = make_tiny_llama(tmp_path / "wider", hidden_size=128)
    reply = engine.update_weights_from_disk(wider)
    assert not reply["success"] and "hidden_size 64 vs 128" in reply["message"]
    reply = engine.update_weights_from_disk(str(tmp_path / "missing"))
    assert not reply["success"] and "does not exist" in reply["message"]
    assert ids(engine) == before and engine.get_weight_version() == "default"


def test_release_refuses_requests_until_resume(engine):
    before = ids(engine)
    assert engine.release_memory_occupation()["released"] == ["kv_cache", "weights"]
    assert engine.scheduler.runner.model is None and engine.scheduler.runner.token_to_kv_pool.k is None
    with pytest.raises(Exception, match="memory is released") as excinfo:
        engine.generate(PROMPT, GREEDY)
    assert getattr(excinfo.value, "status", None) == 503
    assert engine.resume_memory_occupation()["released"] == []
    assert ids(engine) == before
    engine.check_integrity()


def test_release_only_the_kv_cache(engine):
    before = ids(engine)
    engine.release_memory_occupation(["kv_cache"])
    assert engine.scheduler.runner.model is not None
    engine.resume_memory_occupation(["kv_cache"])
    assert ids(engine) == before
