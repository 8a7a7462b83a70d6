"""RadixAttention through the Engine: reuse never changes a greedy output, namespaces
isolate, policies agree, and the KV accounting holds after evictions."""

import random

import pytest

from engine_helpers import make_engine

SYSTEM = "You are a careful assistant. Answer briefly and cite the handbook section. " * 4
GREEDY = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}


def sharing_workload(seed=0, n=24):
    """Heavy sharing with partial matches: common system prompt, a few shared documents,
    questions that share prefixes with each other, and some unrelated prompts."""
    rng = random.Random(seed)
    docs = [f"Document {d}: " + " ".join(f"fact{d}_{i}" for i in range(20)) for d in range(3)]
    prompts = []
    for i in range(n):
        kind = rng.random()
        if kind < 0.7:
            doc = rng.choice(docs)
            q = rng.choice(["What is", "What is the", "Why is", "Summarize"]) + f" item {rng.randint(0, 5)}?"
            prompts.append(SYSTEM + doc + "\nQuestion: " + q)
        elif kind < 0.85:
            prompts.append(SYSTEM + f"Unrelated note {i}")
        else:
            prompts.append(f"Standalone prompt {i} " * rng.randint(1, 4))
    return prompts


def run(engine, prompts, params=GREEDY, batch=True):
    if batch:
        return [o["output_ids"] for o in engine.generate(prompts, params)]
    return [engine.generate(p, params)["output_ids"] for p in prompts]


@pytest.fixture(scope="module")
def reference(tiny_model_path):
    prompts = sharing_workload()
    with make_engine(tiny_model_path, disable_radix_cache=True, max_total_tokens=16384) as eng:
        outs = run(eng, prompts, batch=False)
        eng.check_integrity()
    return prompts, outs


@pytest.mark.parametrize("config", [
    dict(max_total_tokens=16384),
    dict(max_total_tokens=600),  # small pool: evictions and retractions
    dict(max_total_tokens=16384, page_size=4),
    dict(max_total_tokens=2048, page_size=16),
    dict(max_total_tokens=16384, schedule_policy="lpm"),
    dict(max_total_tokens=16384, schedule_policy="dfs-weight"),
    dict(max_total_tokens=900, chunked_prefill_size=32, schedule_policy="lpm"),
    dict(max_total_tokens=16384, force_overlap_schedule=True),  # the overlap scheduler (GPU default)
], ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_cache_on_matches_cache_off(tiny_model_path, reference, config):
    prompts, expected = reference
    with make_engine(tiny_model_path, **config) as eng:
        # sequential (every request sees the previous ones cached), then all at once, twice
        assert run(eng, prompts, batch=False) == expected
        assert run(eng, prompts) == expected
        assert run(eng, prompts) == expected
        state = eng.get_internal_state()
        assert state["num_cached_tokens"] > 0
        eng.check_integrity()


def test_cached_tokens_reported(tiny_engine):
    tiny_engine.flush_cache()
    prompt = SYSTEM + "first question"
    first = tiny_engine.generate(prompt, GREEDY)
    assert first["meta_info"]["cached_tokens"] == 0
    second = tiny_engine.generate(SYSTEM + "second question", GREEDY)
    shared = len(tiny_engine.tokenizer.encode(SYSTEM))
    assert second["meta_info"]["cached_tokens"] >= shared - 1
    assert tiny_engine.get_internal_state()["cache_hit_rate"] > 0


def test_cache_salt_isolates(tiny_engine):
    prompt = SYSTEM + "a salted question"
    tiny_engine.generate(prompt, GREEDY, cache_salt="tenant-a")
    other = tiny_engine.generate(prompt, GREEDY, cache_salt="tenant-b")
    assert other["meta_info"]["cached_tokens"] == 0
    same = tiny_engine.generate(prompt, GREEDY, cache_salt="tenant-a")
    assert same["meta_info"]["cached_tokens"] > 0
    keyed = tiny_engine.generate(prompt, GREEDY, cache_salt="tenant-a", extra_key="lora-1")
    assert keyed["meta_info"]["cached_tokens"] == 0
    assert same["output_ids"] == other["output_ids"] == keyed["output_ids"]


def test_disable_radix_cache(tiny_model_path):
    with make_engine(tiny_model_path, disable_radix_cache=True, max_total_tokens=4096) as eng:
        eng.generate(SYSTEM + "one", GREEDY)
        out = eng.generate(SYSTEM + "two", GREEDY)
        assert out["meta_info"]["cached_tokens"] == 0
        eng.check_integrity()


def test_flush_cache(tiny_engine):
    tiny_engine.generate(SYSTEM + "flush me", GREEDY)
    assert tiny_engine.get_internal_state()["cached_tokens"] > 0
    assert tiny_engine.flush_cache()["success"]
    state = tiny_engine.get_internal_state()
    assert state["cached_tokens"] == 0 and state["integrity"] == "ok"
    out = tiny_engine.generate(SYSTEM + "flush me", GREEDY)
    assert out["meta_info"]["cached_tokens"] == 0


def test_flush_refused_while_busy(tiny_engine):
    stream = tiny_engine.generate("busy " * 10, {"max_new_tokens": 500, "ignore_eos": True}, stream=True)
    next(stream)
    reply = tiny_engine.flush_cache()
    stream.close()
    assert not reply["success"] and "pending requests" in reply["message"]
    tiny_engine.check_integrity()


def test_chunked_prompt_chunks_are_reusable(tiny_model_path):
    long_prompt = " ".join(f"token{i}" for i in range(120))
    with make_engine(tiny_model_path, chunked_prefill_size=32, max_total_tokens=4096) as eng:
        stream = eng.generate(long_prompt, {"max_new_tokens": 400, "ignore_eos": True}, stream=True)
        next(stream)  # the prompt is fully prefilled (in chunks) once the first token arrives
        other = eng.generate(long_prompt + " and more", GREEDY)
        stream.close()
        assert other["meta_info"]["cached_tokens"] >= len(eng.tokenizer.encode(long_prompt)) - 32
        eng.check_integrity()


def test_long_shared_prefix_decode_matches_cache_off(tiny_model_path, reference):
    """A batch sharing a >256-token cached prefix decodes through the cascade path."""
    doc = " ".join(f"clause{i}" for i in range(200))
    prompts = [doc + f" Question {i}: what about clause{i * 7}?" for i in range(6)]
    params = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    with make_engine(tiny_model_path, disable_radix_cache=True, max_total_tokens=16384) as eng:
        expected = run(eng, prompts, params, batch=False)
    with make_engine(tiny_model_path, max_total_tokens=16384) as eng:
        eng.generate(doc, {"max_new_tokens": 0})  # cache the document
        assert run(eng, prompts, params) == expected
        eng.check_integrity()
