"""`sgl.Runtime`: SGLang's wrapper that runs the server in a subprocess.

    runtime = sgl.Runtime(model_path=..., **server_flags)   # a free port from 30000 up
    runtime.url, runtime.endpoint                            # the address; a RuntimeEndpoint on it
    sgl.set_default_backend(runtime)                         # programs run on it
    runtime.generate("Hi", {"max_new_tokens": 4})            # the /generate answer as a JSON string
    runtime.get_tokenizer().encode("Hi")
    runtime.shutdown()                                       # also at interpreter exit
"""

import asyncio
import json

import pytest
import requests

import lmprog as sgl


@pytest.fixture(scope="module")
def runtime(tiny_model_path):
    rt = sgl.Runtime(model_path=tiny_model_path, dtype="float32", max_total_tokens=4096, num_threads=1,
                     log_level="warning")
    yield rt
    rt.shutdown()  # the server stops (checked here: a second server would cost a minute)
    with pytest.raises(requests.ConnectionError):
        requests.get(rt.url + "/health", timeout=5)
    rt.shutdown()  # idempotent


def test_runtime_serves_on_its_url(runtime):
    assert runtime.url.startswith("http://127.0.0.1:")
    assert requests.get(runtime.url + "/health", timeout=30).status_code == 200
    assert isinstance(runtime.endpoint, sgl.RuntimeEndpoint)


def test_generate_returns_json_text_and_async_generate_streams(runtime):
    out = json.loads(runtime.generate("Hello", {"max_new_tokens": 5, "temperature": 0}, return_logprob=True))
    assert len(out["output_ids"]) == 5 and len(out["meta_info"]["output_token_logprobs"]) == 5

    async def collect():
        return [piece async for piece in runtime.async_generate("Hello", {"max_new_tokens": 5, "temperature": 0})]

    assert "".join(asyncio.run(collect())) == out["text"]


def test_tokenizer_matches_the_server(runtime):
    tokens = requests.post(runtime.url + "/tokenize", json={"prompt": "Hello world"}, timeout=30).json()["tokens"]
    assert runtime.get_tokenizer().encode("Hello world") == tokens


def test_runtime_is_a_program_backend(runtime):
    @sgl.function
    def hello(s):
        s += "Hello" + sgl.gen("x", max_tokens=5, temperature=0)

    sgl.set_default_backend(runtime)
    try:
        state = hello.run()
        state.sync()  # run() returns at once, as SGLang's does: flushing now would race the gen
        assert sgl.flush_cache() is None  # SGLang's RuntimeEndpoint answers None
    finally:
        sgl.set_default_backend(None)
    assert state["x"] == json.loads(runtime.generate("Hello", {"max_new_tokens": 5, "temperature": 0}))["text"]


def test_bad_flags_fail_before_anything_starts():
    with pytest.raises(TypeError, match="no_such_flag"):
        sgl.Runtime(no_such_flag=1)
    with pytest.raises(ValueError, match="tensor parallelism is not supported yet"):
        sgl.Runtime(tp_size=2)
