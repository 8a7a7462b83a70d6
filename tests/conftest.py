import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
_TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _TESTS)  # `import tiny_model` from any test
if os.path.dirname(_TESTS) not in sys.path:  # the repo root, when the package is not installed
    sys.path.insert(0, os.path.dirname(_TESTS))

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


def make_engine(model_path, **kwargs):
    """An Engine with test defaults; the caller shuts it down."""
    from lmprog_runtime import Engine

    kwargs.setdefault("dtype", "float32")
    return Engine(model_path=model_path, **kwargs)


@pytest.fixture(scope="session")
def engine_backend(tiny_engine):
    """The in-process runtime for lmprog's live program tests (wrapped by the test)."""
    return tiny_engine
