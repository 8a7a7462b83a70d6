"""The in-process Engine on the tiny model: result shapes, sampling surface, stops,
logprobs, bad parameters, retraction, chunked prefill and aborts."""

import pytest
import torch

from engine_helpers import make_engine
from lmprog_runtime.generate_request import RequestError

GREEDY = {"temperature": 0, "max_new_tokens": 12}
PROMPTS = ["Hello world", "The quick brown fox jumps over", "1, 2, 3, 4,", "Once upon a time",
           "def fibonacci(n):", "Paris is the capital of", "a b c d e f g h i j k l m n o p", "Q: why?\nA:"]


def greedy(engine, prompt, **params):
    return engine.generate(prompt, {**GREEDY, **params})


def test_result_shape(tiny_engine):
    out = greedy(tiny_engine, "Hello world")
    assert set(out) >= {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    for key in ("id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "e2e_latency"):
        assert key in meta
    assert meta["finish_reason"] == {"type": "length", "length": 12}
    assert meta["completion_tokens"] == len(out["output_ids"]) == 12
    assert out["text"] == tiny_engine.tokenizer.decode(out["output_ids"])
    tiny_engine.check_integrity()


def test_batch_and_input_ids(tiny_engine):
    outs = tiny_engine.generate(PROMPTS[:3], GREEDY)
    assert [o["output_ids"] for o in outs] == [greedy(tiny_engine, p)["output_ids"] for p in PROMPTS[:3]]
    ids = tiny_engine.tokenizer.encode(PROMPTS[1])
    assert tiny_engine.generate(input_ids=ids, sampling_params=GREEDY)["output_ids"] == outs[1]["output_ids"]


def test_stop_string_trimmed_and_kept(tiny_engine):
    base = greedy(tiny_engine, PROMPTS[1], max_new_tokens=20)
    text = base["text"]
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop.strip(), text
    out = greedy(tiny_engine, PROMPTS[1], max_new_tokens=20, stop=stop)
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stop not in out["text"] and text.startswith(out["text"])
    kept = greedy(tiny_engine, PROMPTS[1], max_new_tokens=20, stop=[stop], no_stop_trim=True)
    assert kept["text"].endswith(stop) or stop in kept["text"]


def test_stop_token_ids_and_min_new_tokens(tiny_engine):
    base = greedy(tiny_engine, PROMPTS[2], max_new_tokens=12)["output_ids"]
    stop_tok = base[1]
    out = greedy(tiny_engine, PROMPTS[2], stop_token_ids=[stop_tok])
    first = base.index(stop_tok)
    assert out["output_ids"] == base[:first + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_tok}
    assert out["text"] == tiny_engine.tokenizer.decode(base[:first])
    # min_new_tokens bans the stop token until reached
    out = greedy(tiny_engine, PROMPTS[2], stop_token_ids=[stop_tok], min_new_tokens=5)
    assert len(out["output_ids"]) >= 5 and stop_tok not in out["output_ids"][:4]


def test_zero_new_tokens_warms_cache(tiny_engine):
    prompt = "A zero-token request caches this prompt for the next one " * 3
    out = tiny_engine.generate(prompt, {"max_new_tokens": 0})
    assert out["output_ids"] == [] and out["text"] == ""
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    again = greedy(tiny_engine, prompt)
    assert again["meta_info"]["cached_tokens"] == again["meta_info"]["prompt_tokens"] - 1


def test_penalties_change_repetition(tiny_engine):
    base = greedy(tiny_engine, PROMPTS[0], max_new_tokens=16)["output_ids"]
    assert len(set(base)) < len(base), "the tiny model should repeat itself"
    for params in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}, {"repetition_penalty": 2.0}):
        out = greedy(tiny_engine, PROMPTS[0], max_new_tokens=16, **params)["output_ids"]
        assert out != base and len(set(out)) > len(set(base)), params


def test_logit_bias_forces_token(tiny_engine):
    out = greedy(tiny_engine, PROMPTS[3], logit_bias={"42": 100.0})
    assert set(out["output_ids"]) == {42}


def test_seed_reproducible(tiny_engine):
    params = {"temperature": 1.0, "top_p": 0.95, "top_k": 50, "max_new_tokens": 16}
    a = tiny_engine.generate(PROMPTS[4], {**params, "sampling_seed": 7})["output_ids"]
    b = tiny_engine.generate(PROMPTS[4], {**params, "sampling_seed": 7})["output_ids"]
    c = tiny_engine.generate(PROMPTS[4], {**params, "sampling_seed": 8})["output_ids"]
    assert a == b and a != c
    # a seeded request gives the same tokens inside a batch of others
    batch = tiny_engine.generate([PROMPTS[4], PROMPTS[5]], [{**params, "sampling_seed": 7}, params])
    assert batch[0]["output_ids"] == a


def test_top_k_one_is_greedy(tiny_engine):
    out = tiny_engine.generate(PROMPTS[5], {"temperature": 0.8, "top_k": 1, "max_new_tokens": 12})
    assert out["output_ids"] == greedy(tiny_engine, PROMPTS[5])["output_ids"]


def test_n_samples(tiny_engine):
    outs = tiny_engine.generate(PROMPTS[6], {"temperature": 1.0, "max_new_tokens": 6, "n": 3})
    assert len(outs) == 3 and all(o["meta_info"]["completion_tokens"] == 6 for o in outs)
    outs = tiny_engine.generate(PROMPTS[:2], {"temperature": 0, "max_new_tokens": 6, "n": 2})
    assert len(outs) == 4 and outs[0]["output_ids"] == outs[1]["output_ids"]
    assert all(o["meta_info"]["cached_tokens"] > 0 for o in outs if o["meta_info"]["prompt_tokens"] > 1)


def test_logprob_shapes(tiny_engine):
    prompt = PROMPTS[1]
    L = len(tiny_engine.tokenizer.encode(prompt))
    out = tiny_engine.generate(prompt, {**GREEDY, "max_new_tokens": 5}, return_logprob=True,
                               logprob_start_len=0, top_logprobs_num=3, token_ids_logprob=[1, 2],
                               return_text_in_logprobs=True)
    meta = out["meta_info"]
    assert len(meta["input_token_logprobs"]) == L
    assert meta["input_token_logprobs"][0][0] is None and meta["input_token_logprobs"][0][1] == \
        tiny_engine.tokenizer.encode(prompt)[0]
    lp, tok, text = meta["input_token_logprobs"][1]
    assert tok == tiny_engine.tokenizer.encode(prompt)[1] and lp <= 0 and isinstance(text, str)
    assert len(meta["output_token_logprobs"]) == meta["output_token_logprobs_length"] == 5
    assert [e[1] for e in meta["output_token_logprobs"]] == out["output_ids"]
    assert len(meta["output_top_logprobs"]) == 5 and all(len(t) == 3 for t in meta["output_top_logprobs"])
    for (lp, tok, _), top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"]):
        assert top[0][1] == tok and abs(top[0][0] - lp) < 1e-5  # greedy picks the top token
    assert len(meta["input_top_logprobs"]) == L and meta["input_top_logprobs"][0] is None
    assert [len(x) for x in meta["output_token_ids_logprobs"]] == [2] * 5
    # output-only by default
    out = tiny_engine.generate(prompt, {**GREEDY, "max_new_tokens": 3}, return_logprob=True)
    assert out["meta_info"]["input_token_logprobs"] == []
    # a one-token prompt still reports its (unscored) first token
    one = tiny_engine.generate(input_ids=[42], sampling_params={"max_new_tokens": 1}, return_logprob=True,
                               logprob_start_len=0)
    assert [e[:2] for e in one["meta_info"]["input_token_logprobs"]] == [[None, 42]]
    # a later start
    out = tiny_engine.generate(prompt, {**GREEDY, "max_new_tokens": 3}, return_logprob=True, logprob_start_len=2)
    assert len(out["meta_info"]["input_token_logprobs"]) == L - 2


def test_input_logprobs_independent_of_cache(tiny_engine):
    prompt = "Scoring a prompt twice must give the same logprobs, cached or not."
    first = tiny_engine.generate(prompt, {"max_new_tokens": 0}, return_logprob=True, logprob_start_len=0)
    second = tiny_engine.generate(prompt, {"max_new_tokens": 0}, return_logprob=True, logprob_start_len=0)
    a = [e[0] for e in first["meta_info"]["input_token_logprobs"][1:]]
    assert first["meta_info"]["input_token_logprobs"][0][0] is None
    b = [e[0] for e in second["meta_info"]["input_token_logprobs"][1:]]
    assert a == pytest.approx(b, abs=1e-4)


@pytest.mark.parametrize("params, message", [
    ({"temperature": -1}, "temperature must be a non-negative finite number, got -1"),
    ({"top_p": 0}, "top_p must be in (0, 1], got 0"),
    ({"top_k": 0}, "top_k must be -1 (disable) or at least 1, got 0"),
    ({"min_p": 1.5}, "min_p must be in [0, 1], got 1.5"),
    ({"frequency_penalty": 3}, "frequency_penalty must be in [-2, 2], got 3"),
    ({"presence_penalty": -3}, "presence_penalty must be in [-2, 2], got -3"),
    ({"repetition_penalty": 0}, "repetition_penalty must be in (0, 2] (1.0 = no penalty), got 0"),
    ({"max_new_tokens": -1}, "max_new_tokens must be at least 0, got -1"),
    ({"max_new_tokens": 4, "min_new_tokens": 5}, "min_new_tokens must be in [0, max_new_tokens(4)], got 5"),
    ({"logit_bias": {"99999999": 1.0}}, "logit_bias must has keys in [0,"),
    ({"bogus": 1}, "Unknown sampling parameter(s): bogus"),
    ({"max_new_tokens": "ten"}, "max_new_tokens must be an integer"),
    ({"regex": "a", "json_schema": "{}"}, "Only one of json_schema, regex, ebnf, or structural_tag can be set."),
])
def test_bad_sampling_params(tiny_engine, params, message):
    with pytest.raises(RequestError) as e:
        tiny_engine.generate("hi", params)
    assert message in str(e.value)
    assert e.value.status == 400


def test_bad_inputs(tiny_engine):
    with pytest.raises(RequestError, match="longer than the model's context length"):
        tiny_engine.generate(input_ids=[5] * 5000, sampling_params=GREEDY)
    with pytest.raises(RequestError, match="contains values greater than the vocab size"):
        tiny_engine.generate(input_ids=[10 ** 7], sampling_params=GREEDY)
    with pytest.raises(RequestError, match="Either text, input_ids"):
        tiny_engine.generate(None, GREEDY)
    with pytest.raises(RequestError, match="input_ids cannot be empty"):
        tiny_engine.generate(input_ids=[], sampling_params=GREEDY)
    # the engine is still fine afterwards
    assert greedy(tiny_engine, "still alive")["meta_info"]["completion_tokens"] == 12
    tiny_engine.check_integrity()


def test_streaming_cumulative(tiny_engine):
    chunks = list(tiny_engine.generate(PROMPTS[7], GREEDY, stream=True))
    final = greedy(tiny_engine, PROMPTS[7])
    assert chunks[-1]["text"] == final["text"] and chunks[-1]["output_ids"] == final["output_ids"]
    assert len(chunks) >= 2
    for a, b in zip(chunks, chunks[1:]):
        assert b["text"].startswith(a["text"])


def test_abort_frees_everything(tiny_engine):
    stream = tiny_engine.generate(PROMPTS[0], {"max_new_tokens": 2000, "ignore_eos": True}, stream=True,
                                  rid="to-abort")
    next(stream)
    tiny_engine.abort("to-abort")
    last = list(stream)[-1]
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    tiny_engine.check_integrity()


def test_early_close_of_stream_aborts(tiny_engine):
    finished = []
    tm = tiny_engine.tm
    previous, tm.on_finish = tm.on_finish, finished.append
    try:
        stream = tiny_engine.generate(PROMPTS[1], {"max_new_tokens": 900, "ignore_eos": True}, stream=True)
        next(stream)
        stream.close()
        tiny_engine.check_integrity()
    finally:
        tm.on_finish = previous
    assert len(finished) == 1, finished
    reason, meta = finished[0].finished_reason, finished[0].meta
    assert reason.type == "abort" and not reason.is_error, reason  # aborted, not run to its end
    assert 1 <= meta["completion_tokens"] < 900, meta


def test_async_generate(tiny_engine):
    import asyncio

    async def main():
        one = await tiny_engine.async_generate(PROMPTS[0], GREEDY)
        chunks = [c async for c in await tiny_engine.async_generate(PROMPTS[0], GREEDY, stream=True)]
        return one, chunks

    one, chunks = asyncio.run(main())
    assert one["output_ids"] == chunks[-1]["output_ids"] == greedy(tiny_engine, PROMPTS[0])["output_ids"]


def _run_all(engine, prompts, params):
    return [o["output_ids"] for o in engine.generate(prompts, params)]


def test_retraction_keeps_outputs(tiny_model_path):
    prompts = [p + " and then" * 3 for p in PROMPTS]
    params = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
    with make_engine(tiny_model_path, max_total_tokens=8192) as big:
        expected = _run_all(big, prompts, params)
    with make_engine(tiny_model_path, max_total_tokens=256) as small:
        outs = small.generate(prompts, params)
        assert [o["output_ids"] for o in outs] == expected
        assert sum(o["meta_info"]["num_retractions"] for o in outs) > 0
        assert small.get_internal_state()["num_retractions"] > 0
        small.check_integrity()


def test_chunked_prefill_same_output(tiny_model_path, tiny_engine):
    prompt = " ".join(f"word{i}" for i in range(60))
    expected = greedy(tiny_engine, prompt)["output_ids"]
    with make_engine(tiny_model_path, chunked_prefill_size=16, max_total_tokens=4096) as eng:
        assert greedy(eng, prompt)["output_ids"] == expected
        eng.check_integrity()


def test_max_running_requests_and_queueing(tiny_model_path, tiny_engine):
    expected = _run_all(tiny_engine, PROMPTS, GREEDY)
    with make_engine(tiny_model_path, max_running_requests=2, max_total_tokens=4096) as eng:
        assert _run_all(eng, PROMPTS, GREEDY) == expected
        eng.check_integrity()


def test_stop_regex(tiny_engine):
    base = greedy(tiny_engine, PROMPTS[1], max_new_tokens=20)["text"]
    import re
    pattern = re.escape(base.split()[2][:2])
    out = greedy(tiny_engine, PROMPTS[1], max_new_tokens=20, stop_regex=[pattern])
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}
    assert out["text"] == base[:re.search(pattern, base).start()]
    with pytest.raises(RequestError, match="invalid stop_regex"):
        tiny_engine.generate("hi", {"stop_regex": "("})


def test_queue_limit_rejects_with_503(tiny_model_path):
    with make_engine(tiny_model_path, max_running_requests=1, max_queued_requests=1,
                     max_total_tokens=4096) as eng:
        outs = []
        import threading

        def call(i):
            try:
                outs.append(eng.generate(PROMPTS[i], {"max_new_tokens": 30, "ignore_eos": True}))
            except RequestError as e:
                outs.append(e)

        threads = [threading.Thread(target=call, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        errors = [o for o in outs if isinstance(o, RequestError)]
        assert errors and all(e.status == 503 and "queue is full" in str(e) for e in errors)
        assert any(isinstance(o, dict) for o in outs)
        eng.check_integrity()


def test_generation_throughput_is_measured(tiny_model_path):
    with make_engine(tiny_model_path, max_total_tokens=4096) as eng:
        import time
        deadline = time.monotonic() + 60
        while eng.get_internal_state()["last_gen_throughput"] == 0 and time.monotonic() < deadline:
            eng.generate(PROMPTS[:4], {"max_new_tokens": 64, "ignore_eos": True})
        assert eng.get_internal_state()["last_gen_throughput"] > 0


def test_bfloat16_kv_cache(tiny_model_path, tiny_engine):
    """--kv-cache-dtype bf16 on a float32 model: the pool holds bfloat16 (half the bytes per
    token), prefill, chunked prefill, cached prefixes and decodes run on it, and every logprob
    stays within bfloat16 rounding of the float32 pool's (greedy tokens may differ only where
    the top two were that close)."""
    from lmprog_runtime.config import ServerArgs

    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        ServerArgs(kv_cache_dtype="fp8_e5m2")
    params = {**GREEDY, "max_new_tokens": 8}
    with make_engine(tiny_model_path, kv_cache_dtype="bf16", max_total_tokens=8192, chunked_prefill_size=16) as eng:
        runner = eng.scheduler.runner
        assert runner.token_to_kv_pool.k.dtype == torch.bfloat16 and runner.dtype == torch.float32
        for prompt in PROMPTS[:4] + [PROMPTS[1] + " over the lazy dog" * 4]:
            got = eng.generate(prompt, params, return_logprob=True, logprob_start_len=0)
            want = tiny_engine.generate(prompt, params, return_logprob=True, logprob_start_len=0)
            g, w = got["meta_info"], want["meta_info"]
            pairs = [(a[0], b[0]) for a, b in zip(g["input_token_logprobs"][1:], w["input_token_logprobs"][1:])]
            pairs += [(a[0], b[0]) for a, b in zip(g["output_token_logprobs"], w["output_token_logprobs"])
                      if a[1] == b[1]]
            assert pairs and max(abs(a - b) for a, b in pairs) < 0.01, prompt  # measured <= 1e-3
            again = eng.generate(prompt, params)  # the prompt now from the radix cache
            assert again["meta_info"]["cached_tokens"] > 0 and again["output_ids"] == got["output_ids"]
        eng.check_integrity()
