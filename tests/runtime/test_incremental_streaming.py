"""`--incremental-streaming-output` (`Engine(incremental_streaming_output=True)`): each streamed
chunk carries only what is new — `text`, `output_ids` and the output-side logprob lists —
instead of everything so far (the default). Joining the chunks gives the non-streamed answer.
The lmprog frontend works against either kind of server.
"""

import pytest

import lmprog as sgl
from engine_helpers import make_engine

PROMPT = "The capital of France is"
PARAMS = {"max_new_tokens": 12, "temperature": 0}


@pytest.fixture(scope="module")
def incremental_engine(tiny_model_path):
    engine = make_engine(tiny_model_path, max_total_tokens=4096, incremental_streaming_output=True)
    yield engine
    engine.shutdown()


def test_chunks_are_deltas_that_join_into_the_answer(incremental_engine):
    chunks = list(incremental_engine.generate(PROMPT, PARAMS, stream=True, return_logprob=True))
    final = incremental_engine.generate(PROMPT, PARAMS, return_logprob=True)
    assert len(chunks) > 1
    assert "".join(c["text"] for c in chunks) == final["text"]
    assert [t for c in chunks for t in c["output_ids"]] == final["output_ids"]
    streamed_lps = [e for c in chunks for e in c["meta_info"]["output_token_logprobs"]]
    final_lps = final["meta_info"]["output_token_logprobs"]
    assert [e[1] for e in streamed_lps] == [e[1] for e in final_lps] == final["output_ids"]
    assert [e[0] for e in streamed_lps] == pytest.approx([e[0] for e in final_lps], abs=1e-4)


def test_default_mode_stays_cumulative(tiny_engine):
    chunks = list(tiny_engine.generate(PROMPT, PARAMS, stream=True, return_logprob=True))
    assert chunks[-1]["output_ids"] == tiny_engine.generate(PROMPT, PARAMS)["output_ids"]
    assert len(chunks[-1]["meta_info"]["output_token_logprobs"]) == len(chunks[-1]["output_ids"])


@pytest.mark.parametrize("fixture", ["tiny_engine", "incremental_engine"])
def test_frontend_streams_the_same_text_in_both_modes(request, fixture):
    backend = sgl.EngineBackend(engine=request.getfixturevalue(fixture))
    assert backend.streams_deltas() == (fixture == "incremental_engine")

    @sgl.function
    def prog(s):
        s += PROMPT + sgl.gen("x", max_tokens=12, temperature=0, return_logprob=True)

    streamed = prog.run(backend=backend, stream=True)
    pieces = list(streamed.text_iter("x"))
    plain = prog.run(backend=backend)
    assert "".join(pieces) == streamed["x"] == plain["x"]
    meta = streamed.get_meta_info("x")  # the executor always holds the cumulative meta_info
    assert len(meta["output_token_logprobs"]) == meta["completion_tokens"]


def test_a_live_incremental_server_and_the_runtime_endpoint(tiny_model_path, tmp_path):
    """The same over HTTP: SSE chunks are deltas, and a RuntimeEndpoint program streams right."""
    import json
    import signal

    import requests
    from server_harness import LiveServer

    server = LiveServer(tiny_model_path, tmp_path, ["--incremental-streaming-output"]).start()
    try:
        body = {"text": PROMPT, "sampling_params": PARAMS}
        whole = requests.post(server.url + "/generate", json=body, timeout=60).json()
        with requests.post(server.url + "/generate", json={**body, "stream": True}, stream=True, timeout=60) as r:
            chunks = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith(b"data:")
                      and line != b"data: [DONE]"]
        assert [t for c in chunks for t in c["output_ids"]] == whole["output_ids"]
        assert "".join(c["text"] for c in chunks) == whole["text"]
        backend = sgl.RuntimeEndpoint(server.url)
        assert backend.streams_deltas()

        @sgl.function
        def prog(s):
            s += PROMPT + sgl.gen("x", max_tokens=12, temperature=0)

        streamed = prog.run(backend=backend, stream=True)
        assert "".join(streamed.text_iter("x")) == whole["text"] == prog.run(backend=backend)["x"]
        backend.shutdown()
    finally:
        assert server.stop(signal.SIGTERM) == 0
