"""The shared program library against the real runtime: the in-process Engine and a live server.

Two fixtures from tests/conftest.py:
- `engine_backend`: an in-process engine on the tiny random-weight model, either an
  `lmprog.EngineBackend` or a raw `lmprog_runtime.Engine` (wrapped here);
- `server_url`: the base URL of a live lmprog_runtime server on 127.0.0.1.
Random weights produce gibberish, so every check asserts structure, not content.
"""

import pytest

import lmprog as sgl
from lmprog.backends.base import BaseBackend
from programs import LIBRARY

BACKENDS = ["engine_backend", "server_url"]


@pytest.fixture(params=BACKENDS)
def live_backend(request):
    value = request.getfixturevalue(request.param)
    if request.param == "server_url":
        backend = sgl.RuntimeEndpoint(value)
        yield backend
        backend.shutdown()
    else:
        yield value if isinstance(value, BaseBackend) else sgl.EngineBackend(engine=value)


@pytest.mark.parametrize("name", sorted(LIBRARY))
def test_library_program_live(live_backend, name):
    LIBRARY[name](live_backend)


def test_select_methods_live(live_backend):
    for method in (sgl.greedy_token_selection, sgl.unconditional_likelihood_normalized):
        LIBRARY["select"](live_backend, choices_method=method)


def test_server_info_and_flush_live(live_backend):
    assert isinstance(sgl.get_server_info(live_backend), dict)
    sgl.flush_cache(live_backend)


def test_openai_backend_against_live_server(server_url):
    url = server_url
    import openai

    model = openai.OpenAI(base_url=url + "/v1", api_key="EMPTY").models.list().data[0].id

    @sgl.function
    def chat(s):
        s += sgl.user("Say hi.")
        s += sgl.assistant(sgl.gen("reply", max_tokens=8))

    state = chat.run(backend=sgl.OpenAI(model, is_chat_model=True, base_url=url + "/v1"), temperature=0)
    assert isinstance(state["reply"], str)
    assert [m["role"] for m in state.messages()] == ["user", "assistant"]

    @sgl.function
    def complete(s):
        s += "Digits:" + sgl.gen("digits", max_tokens=4, regex="[0-9]{1,3}")

    state = complete.run(backend=sgl.OpenAI(model, is_chat_model=False, base_url=url + "/v1"), temperature=0)
    assert state["digits"].isdigit()
