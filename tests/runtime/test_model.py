"""Model execution: our Llama file + loader + torch_native attention against transformers.

Batches are built by hand here (the scheduler is tested elsewhere): each request owns a
row of the req_to_token table and fresh KV slots from a counter.
"""

from __future__ import annotations

import os

import pytest
import torch

from lmprog_runtime.config import ServerArgs
from lmprog_runtime.model_executor.forward_batch import ForwardBatch
from lmprog_runtime.model_executor.loader import load_model_config
from lmprog_runtime.model_paths import resolve_model_path
from lmprog_runtime.model_executor.runner import ModelRunner


class HandBatcher:
    """Builds ForwardBatches for (row, tokens already cached, new token ids) triples."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.next_slot = 1  # slot 0 is the padding slot

    def batch(self, reqs, all_logits: bool = False) -> ForwardBatch:
        table = self.runner.req_to_token_pool.table
        ids, positions, locs = [], [], []
        for row, cached, new in reqs:
            slots = torch.arange(self.next_slot, self.next_slot + len(new))
            self.next_slot += len(new)
            table[row, cached:cached + len(new)] = slots
            ids += list(new)
            positions += range(cached, cached + len(new))
            locs.append(slots)
        seq_lens = [cached + len(new) for _, cached, new in reqs]
        extend_lens = [len(new) for _, _, new in reqs]
        t = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
        return ForwardBatch(
            input_ids=t(ids), positions=t(positions), out_cache_loc=torch.cat(locs),
            req_pool_indices=t([row for row, _, _ in reqs]), seq_lens=t(seq_lens), extend_lens=t(extend_lens),
            req_to_token=table, logits_indices=torch.arange(len(ids)) if all_logits else None,
            seq_lens_cpu=seq_lens, extend_lens_cpu=extend_lens,
        )


def greedy(runner: ModelRunner, prompts, max_new_tokens: int):
    """Prefill all prompts in one ragged batch, then decode them together."""
    hb = HandBatcher(runner)
    rows = list(range(1, len(prompts) + 1))
    outs = [[] for _ in prompts]
    logits = runner.forward(hb.batch([(r, 0, p) for r, p in zip(rows, prompts)]))
    for _ in range(max_new_tokens):
        for out, tok in zip(outs, logits.argmax(-1).tolist()):
            out.append(tok)
        lens = [len(p) + len(o) - 1 for p, o in zip(prompts, outs)]
        logits = runner.forward(hb.batch([(r, n, [o[-1]]) for r, n, o in zip(rows, lens, outs)]))
    return outs


def hf_logits(hf_model, tokens) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0].float()  # [len, vocab]


def assert_logits_match(ours: torch.Tensor, ref: torch.Tensor, rel: float = 1e-4):
    scale = max(1.0, ref.abs().max().item())
    diff = (ours - ref).abs().max().item()
    assert diff <= rel * scale, f"max abs diff {diff:.3g} > {rel:g} x logit scale {scale:.3g}"


def check_ragged_batches(runner: ModelRunner, hf_model, vocab: int):
    """Two prefills + a cached-prefix extend + decodes, all logits rows compared with HF."""
    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.randint(3, vocab, (n,), generator=g).tolist() for n in (7, 12, 14))
    hb = HandBatcher(runner)
    # step 1: prefill a, b and c's first 9 tokens
    out1 = runner.forward(hb.batch([(1, 0, a), (2, 0, b), (3, 0, c[:9])], all_logits=True))
    # step 2: mixed: c extends over its cached prefix, a and b decode one token
    a.append(5), b.append(6)
    out2 = runner.forward(hb.batch([(3, 9, c[9:]), (1, 7, a[-1:]), (2, 12, b[-1:])], all_logits=True))
    # step 3: pure decode of all three
    a.append(7), b.append(8), c.append(9)
    out3 = runner.forward(hb.batch([(1, 8, a[-1:]), (2, 13, b[-1:]), (3, 14, c[-1:])]))
    ra, rb, rc = (hf_logits(hf_model, x) for x in (a, b, c))
    assert out1.dtype == torch.float32 and out1.shape == (7 + 12 + 9, vocab)
    assert_logits_match(out1, torch.cat([ra[:7], rb[:12], rc[:9]]))
    assert_logits_match(out2, torch.cat([rc[9:14], ra[7:8], rb[12:13]]))
    assert_logits_match(out3, torch.stack([ra[8], rb[13], rc[14]]))


def tiny_runner(path, **kw) -> ModelRunner:
    return ModelRunner(ServerArgs(model_path=path, dtype="float32", max_total_tokens=2048,
                                  max_running_requests=8, **kw))


# -- tiny random models -------------------------------------------------------------------------------
def test_tiny_llama_matches_transformers(tiny_model_path):
    from transformers import LlamaForCausalLM

    runner = tiny_runner(tiny_model_path)
    hf = LlamaForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    check_ragged_batches(runner, hf, runner.model_config.vocab_size)
    assert runner.tokenizer.chat_template and runner.model_config.eos_token_ids == (2,)


def test_qwen2_style_bias_matches_transformers(tmp_path):
    from tiny_model import make_tiny_llama
    from transformers import Qwen2ForCausalLM

    path = make_tiny_llama(tmp_path, model_type="qwen2", tie_word_embeddings=False)
    runner = tiny_runner(path)
    assert runner.model_config.attention_bias and not runner.model_config.tie_word_embeddings
    hf = Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    check_ragged_batches(runner, hf, runner.model_config.vocab_size)


def test_llama3_rope_scaling_matches_transformers(tmp_path):
    from tiny_model import make_tiny_llama
    from transformers import LlamaForCausalLM

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    path = make_tiny_llama(tmp_path, rope_parameters=rope)
    runner = tiny_runner(path)
    assert runner.model_config.rope_scaling["rope_type"] == "llama3"
    hf = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    check_ragged_batches(runner, hf, runner.model_config.vocab_size)


# -- the real SmolLM2 from the embedded GGUF ------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2():
    from transformers import AutoModelForCausalLM

    runner = ModelRunner(ServerArgs(dtype="float32", max_total_tokens=4096, max_running_requests=8))
    gguf = resolve_model_path("default")
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf),
                                              dtype=torch.float32).eval()
    return runner, hf


@pytest.mark.slow
def test_smollm2_logits_match_transformers(smollm2):
    runner, hf = smollm2
    c = runner.model_config
    assert (c.architecture, c.num_layers, c.num_heads, c.num_kv_heads, c.hidden_size) == ("llama", 30, 9, 3, 576)
    check_ragged_batches(runner, hf, c.vocab_size)


@pytest.mark.slow
def test_smollm2_greedy_matches_transformers_generate(smollm2):
    runner, hf = smollm2
    tok = runner.tokenizer
    chat = lambda q: tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,  # noqa: E731
                                             add_generation_prompt=True)
    texts = [chat("What is the capital of France?"), chat("Write a haiku about the sea."),
             "The quick brown fox", "def fibonacci(n):", chat("List three prime numbers.")]
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    ours = greedy(runner, prompts, 32)
    # reference: one left-padded transformers batch (32 steps rather than 5 x 32)
    width = max(map(len, prompts))
    ids = torch.tensor([[2] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        ref = hf.generate(ids, attention_mask=mask, max_new_tokens=32, do_sample=False,
                          eos_token_id=None, pad_token_id=2)
    for got, want in zip(ours, ref[:, width:].tolist()):
        assert got == want, (tok.decode(got), tok.decode(want))


# -- loader ----------------------------------------------------------------------------------------
def test_default_resolves_to_embedded_gguf():
    path = resolve_model_path("default")
    assert path.endswith(".gguf") and os.path.isfile(path)


def test_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model_path(str(tmp_path / "nope"))


def test_folder_without_config_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model_path(str(tmp_path))


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(ValueError, match=r"unsupported architecture 'gpt2'.*llama"):
        load_model_config(resolve_model_path(str(tmp_path)))


def test_corrupt_gguf_is_a_clear_error(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(64))
    with pytest.raises(ValueError, match="broken.gguf.*not a readable GGUF"):
        load_model_config(resolve_model_path(str(bad)))
    bad.write_bytes(b"NOPE" * 16)
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_model_config(str(bad))


def test_corrupt_safetensors_is_a_clear_error(tiny_model_path, tmp_path):
    import shutil

    folder = shutil.copytree(tiny_model_path, tmp_path / "m")
    (folder / "model.safetensors").write_bytes(b"\x00" * 100)
    with pytest.raises(ValueError, match="model.safetensors.*unreadable"):
        tiny_runner(str(folder))


def test_impossible_device_and_unknown_backend():
    from lmprog_runtime.attention import create_attention_backend
    from lmprog_runtime.model_executor.runner import select_device

    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            select_device("cuda")
    with pytest.raises(ImportError, match="backend 'flashinfer' is not available"):
        create_attention_backend("flashinfer")
    with pytest.raises(ValueError, match="unknown attention backend"):
        create_attention_backend("nope")


def test_gguf_model_config_is_cached_and_equal_to_the_conversion(monkeypatch, tmp_path):
    """A warm start reads the GGUF's ModelConfig from one JSON file, no transformers: the same
    config as the conversion, context_length applied on top; a corrupt file is converted again."""
    import lmprog_runtime.config as config
    from lmprog_runtime.model_executor import loader

    path = resolve_model_path("default")
    monkeypatch.setattr(config, "CACHE_DIR", str(tmp_path))
    convert = loader.load_hf_config
    want = loader.ModelConfig.from_hf(convert(path), 1024)
    assert load_model_config(path, 1024) == want
    cache = loader._model_config_cache(path)
    assert cache.startswith(str(tmp_path)) and os.path.isfile(cache)
    monkeypatch.setattr(loader, "load_hf_config", lambda p: pytest.fail("converted again"))
    assert load_model_config(path, 1024) == want
    assert load_model_config(path).context_length == loader.ModelConfig.from_hf(convert(path)).context_length
    with open(cache, "w") as f:
        f.write("{not json")
    monkeypatch.setattr(loader, "load_hf_config", convert)
    assert load_model_config(path, 1024) == want
