import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
_TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _TESTS)  # `import tiny_model` from any test
if os.path.dirname(_TESTS) not in sys.path:  # the repo root, when the package is not installed
    sys.path.insert(0, os.path.dirname(_TESTS))

import signal  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory):
    """A tiny random Llama folder with the real SmolLM2 tokenizer (see tests/tiny_model.py)."""
    from tiny_model import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def tiny_engine(tiny_model_path):
    """One in-process Engine on the tiny model (float32, radix cache on), shared by tests."""
    from lmprog_runtime import Engine

    engine = Engine(model_path=tiny_model_path, dtype="float32", max_total_tokens=8192,
                    random_seed=0)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def engine_backend(tiny_engine):
    """The in-process runtime for lmprog's live program tests (wrapped by the test)."""
    return tiny_engine


@pytest.fixture(scope="session")
def live_server_handle(tiny_model_path, tmp_path_factory):
    """One real two-process server on the tiny model for the whole session.

    Teardown checks the shutdown contract: SIGTERM → exit code 0, the scheduler child
    gone, the port free again."""
    from server_harness import LiveServer, pid_alive, port_is_free

    server = LiveServer(tiny_model_path, tmp_path_factory.mktemp("live_server"),
                        extra_args=["--tool-call-parser", "qwen25"]).start()  # tools: test_tool_calling.py
    import requests
    scheduler_pid = requests.get(server.url + "/get_server_info", timeout=30).json()["scheduler_pid"]
    yield server
    code = server.stop(signal.SIGTERM)
    assert code == 0, f"server exit code {code}:\n{server.log_tail()}"
    assert not pid_alive(scheduler_pid), "the scheduler process outlived the server"
    assert port_is_free(server.port)


@pytest.fixture(scope="session")
def live_server(live_server_handle):
    """Base URL (http://127.0.0.1:PORT) of the session's live server."""
    return live_server_handle.url


@pytest.fixture(scope="session")
def server_url(live_server):
    """The live server's base URL, for lmprog's live program tests."""
    return live_server
