"""`sgl.Engine` is SGLang's offline engine, and a program backend too.

    import lmprog as sgl
    llm = sgl.Engine(model_path=...)            # every server flag is a keyword
    llm.generate("The capital of France is", {"max_new_tokens": 8})["text"]
    llm.generate(["a", "b"], [{"max_new_tokens": 4}, {"max_new_tokens": 2}])   # a list per prompt
    for chunk in llm.generate("Hi", {"max_new_tokens": 4}, stream=True): ...   # cumulative chunks
    await llm.async_generate("Hi", {"max_new_tokens": 4})
    sgl.set_default_backend(llm)                # programs run on it (through llm.endpoint)
    llm.shutdown()                              # or `with sgl.Engine(...) as llm:`

On the tiny random-weight model the text is gibberish; the checks are on structure and on
agreement between the ways of asking.
"""

import asyncio

import pytest

import lmprog as sgl

GREEDY = {"max_new_tokens": 6, "temperature": 0}


@pytest.fixture(scope="module")
def llm(tiny_engine):
    """`sgl.Engine` over the session's runtime engine (`engine=` wraps without owning it)."""
    return sgl.Engine(engine=tiny_engine)


def test_generate_one_prompt_positionally_and_by_keyword(llm):
    out = llm.generate("The capital of France is", GREEDY)
    assert isinstance(out["text"], str) and len(out["output_ids"]) == 6
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    again = llm.generate(prompt="The capital of France is", sampling_params=GREEDY)
    assert again["output_ids"] == out["output_ids"]


def test_generate_a_list_of_prompts_with_one_or_many_sampling_params(llm):
    prompts = ["The capital of France is", "One plus one is"]
    outs = llm.generate(prompts, GREEDY)
    assert [len(o["output_ids"]) for o in outs] == [6, 6]
    assert outs[0]["output_ids"] == llm.generate(prompts[0], GREEDY)["output_ids"]
    per_prompt = llm.generate(prompts, [{"max_new_tokens": 3, "temperature": 0}, {"max_new_tokens": 1}])
    assert [len(o["output_ids"]) for o in per_prompt] == [3, 1]


def test_generate_with_logprobs(llm):
    out = llm.generate("Hello", GREEDY, return_logprob=True, top_logprobs_num=2)
    entries = out["meta_info"]["output_token_logprobs"]
    assert [e[1] for e in entries] == out["output_ids"] and all(e[0] <= 0 for e in entries)
    assert all(len(top) == 2 for top in out["meta_info"]["output_top_logprobs"])


def test_generate_stream_yields_cumulative_chunks(llm):
    chunks = list(llm.generate("The capital of France is", GREEDY, stream=True))
    final = llm.generate("The capital of France is", GREEDY)
    assert chunks[-1]["text"] == final["text"] and chunks[-1]["output_ids"] == final["output_ids"]
    assert all(b["text"].startswith(a["text"]) for a, b in zip(chunks, chunks[1:]))


def test_async_generate_and_async_stream(llm):
    async def main():
        out = await llm.async_generate("The capital of France is", GREEDY)
        stream = await llm.async_generate("The capital of France is", GREEDY, stream=True)
        chunks = [c async for c in stream]
        return out, chunks

    out, chunks = asyncio.run(main())
    assert chunks[-1]["output_ids"] == out["output_ids"] == llm.generate("The capital of France is",
                                                                          GREEDY)["output_ids"]


def test_unsupported_keywords_are_refused_by_name(llm):
    with pytest.raises(TypeError, match="lora_path"):
        llm.generate("Hi", GREEDY, lora_path="adapter")


def test_the_engine_is_a_program_backend(llm):
    @sgl.function
    def capital(s):
        s += "The capital of France is" + sgl.gen("answer", max_tokens=6, temperature=0)

    sgl.set_default_backend(llm)
    try:
        state = capital.run()
        assert state["answer"] == llm.generate("The capital of France is", GREEDY)["text"]
        assert sgl.get_server_info()["model_path"] == llm.get_server_info()["model_path"]
        assert capital.trace().backend is llm.endpoint  # tracing unwraps the engine too
    finally:
        sgl.set_default_backend(None)
    assert capital.run(backend=llm)["answer"] == state["answer"]


def test_an_owned_engine_is_a_context_manager(tiny_model_path):
    with sgl.Engine(model_path=tiny_model_path, dtype="float32", max_total_tokens=2048) as llm:
        assert llm.get_model_info()["model_path"] == tiny_model_path
        assert len(llm.generate("Hi", {"max_new_tokens": 2})["output_ids"]) == 2
    assert llm.engine._closed  # shut down on leaving the block
