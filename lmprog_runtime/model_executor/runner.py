"""ModelRunner: the model, its KV memory and its attention backend on one device.

Built once by the scheduler from `ServerArgs`:
device -> threads -> config/tokenizer -> dtype -> weights -> KV pools -> attention backend.
`forward(forward_batch)` returns float32 logits [L, vocab] for the rows the batch asks for.
"""

from __future__ import annotations

import logging
import os
import time
from typing import List

import torch

from lmprog_runtime.attention import create_attention_backend
from lmprog_runtime.cache.kv_pool import ReqToTokenPool, TokenToKVPool
from lmprog_runtime.config import ServerArgs
from lmprog_runtime.model_executor.forward_batch import ForwardBatch
from lmprog_runtime.model_executor.probe import FormatChoice, select_formats
from lmprog_runtime.model_executor import hugepages, weight_cache
from lmprog_runtime.model_executor.quant import quantize_model
from lmprog_runtime.model_executor.loader import (
    ModelConfig, gguf_is_quantized, iter_weights, load_model_config, load_tokenizer,
)
from lmprog_runtime.model_paths import resolve_model_path

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_MAX_RUNNING_REQUESTS = 256
GPU_MAX_RUNNING_REQUESTS = 1024
CPU_KV_CAP_BYTES = 4 << 30  # the KV pool on a CPU never takes more than 4 GiB by default
CPU_MEM_FRACTION = 0.3  # of available host memory, when mem_fraction_static is unset
GPU_MEM_FRACTION = 0.85  # of total device memory for weights + KV, when unset


def _architecture_class(arch: str):
    from lmprog_runtime.models.llama import LlamaForCausalLM

    return {"llama": LlamaForCausalLM, "qwen2": LlamaForCausalLM}[arch]


def default_num_threads() -> int:
    """The cores this process may run on (its affinity mask, e.g. a container's cpuset)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def select_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was requested but no CUDA device is available (use --device cpu or auto)")
    return torch.device(name)


def default_attention_backend(device: torch.device) -> str:
    """torch_native on the CPU; triton on CUDA (in-repo kernels, tested against torch_native,
    no JIT build at start-up). flashinfer is opt-in: `--attention-backend flashinfer`."""
    return "triton" if device.type == "cuda" else "torch_native"


def select_dtype(name: str, device: torch.device, config: ModelConfig) -> torch.dtype:
    """The dense dtype for `--dtype` with no quantization (CPU auto: measured, see probe.py)."""
    if name == "auto" and device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device.type == "cpu" and name == "float16":
        logger.warning("float16 on CPU is slow and poorly supported; prefer float32 or bfloat16")
    return select_formats(name, "none", device, config, False).dense_dtype


def _available_host_bytes() -> int:
    import psutil

    return psutil.virtual_memory().available


class ModelRunner:
    def __init__(self, server_args: ServerArgs):
        self.server_args = server_args
        self.device = select_device(server_args.device)
        if self.device.type == "cpu":
            torch.set_num_threads(server_args.num_threads or default_num_threads())
        torch.manual_seed(server_args.random_seed)

        self.model_path = resolve_model_path(server_args.model_path)
        self.model_config = load_model_config(self.model_path, server_args.context_length)
        self.context_length = self.model_config.context_length
        self.tokenizer = load_tokenizer(resolve_model_path(server_args.tokenizer_path or server_args.model_path))
        self.formats = self._select_formats()
        self.dtype = self.formats.dense_dtype
        # --kv-cache-dtype: the model's dtype, or bfloat16 (K/V rounded when written, widened
        # exactly when read: attention's arithmetic stays in the activations' dtype)
        self.kv_dtype = self.dtype if server_args.kv_cache_dtype == "auto" else torch.bfloat16
        self.quantization = self.formats.quant or "none"
        self.model = self._load_model()

        self.page_size = server_args.page_size
        self.max_running_requests = server_args.max_running_requests or (
            CPU_MAX_RUNNING_REQUESTS if self.device.type == "cpu" else GPU_MAX_RUNNING_REQUESTS)
        self.max_total_num_tokens = self._kv_pool_size()
        self.req_to_token_pool = ReqToTokenPool(self.max_running_requests, self.context_length, self.device)
        c = self.model_config
        self.token_to_kv_pool = TokenToKVPool(self.max_total_num_tokens, c.num_layers, c.num_kv_heads, c.head_dim,
                                              self.kv_dtype, self.device, self.page_size)
        self.attention_backend_name = server_args.attention_backend or default_attention_backend(self.device)
        self.attn_backend = create_attention_backend(
            self.attention_backend_name, token_to_kv_pool=self.token_to_kv_pool,
            num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim)
        self.model.attn_backend = self.attn_backend

    def _select_formats(self) -> FormatChoice:
        args = self.server_args
        if self.device.type == "cuda" and args.dtype == "auto" and args.quantization in ("auto", "none"):
            return FormatChoice(select_dtype("auto", self.device, self.model_config), None, torch.float32, None)
        # only `auto` with `--dtype auto` asks whether the file's weights arrive quantized
        quantized = args.quantization == "auto" and args.dtype == "auto" and gguf_is_quantized(self.model_path)
        return select_formats(args.dtype, args.quantization, self.device, self.model_config, quantized,
                              deterministic=args.enable_deterministic_inference)

    def _build_model(self, quantized_structure: bool) -> torch.nn.Module:
        """The model on the meta device (with empty QuantLinears when `quantized_structure`)."""
        cls, f = _architecture_class(self.model_config.architecture), self.formats
        with torch.device("meta"):
            model = cls(self.model_config, max_positions=self.context_length)
            if quantized_structure and f.quant is not None:
                model = model.to(self.dtype)
                quantize_model(model, f.quant, f.act_dtype, f.dense_rows, empty=True,
                               dense_weight_dtype=f.dense_weight_dtype)
        return model

    def _load_model(self) -> torch.nn.Module:
        """Weights from the converted-weights cache when present, else converted and cached."""
        t0, f = time.perf_counter(), self.formats
        cache = weight_cache.cache_file(self.model_path, f, self.dtype)
        model = weight_cache.load(lambda: self._build_model(True), cache)
        if model is not None:
            logger.info("weights: %s from %s in %.2f s", self.quantization, cache, time.perf_counter() - t0)
            return self._placed(model.to(self.device))
        model = self._build_model(False).to_empty(device="cpu")
        int4_sources = {} if f.quant == "int4" else None
        model.load_weights(iter_weights(self.model_path, self.model_config, int4_sources=int4_sources))
        model = model.to(dtype=self.dtype).eval()
        if f.quant is not None:
            n = quantize_model(model, f.quant, f.act_dtype, f.dense_rows, int4_sources,
                               dense_weight_dtype=f.dense_weight_dtype)
            logger.info("weights: %d projections in %s (kernels in %s, dense from %s rows)",
                        n, f.quant, f.act_dtype, f.dense_rows)
        weight_cache.save(model, cache)
        logger.info("weights: converted in %.2f s", time.perf_counter() - t0)
        return self._placed(model.to(self.device))

    def _placed(self, model: torch.nn.Module) -> torch.nn.Module:
        """On the CPU, the quantized weights in huge pages where the OS gives them (hugepages.py)."""
        if self.device.type == "cpu":
            hugepages.place_weights(model)
        return model

    def _kv_pool_size(self) -> int:
        """KV slots: `max_total_tokens` if given, else what the memory budget allows, in whole pages."""
        c, args = self.model_config, self.server_args
        per_token = TokenToKVPool.bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, self.kv_dtype)
        if args.max_total_tokens is not None:
            tokens = args.max_total_tokens
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = free - total * (1 - (args.mem_fraction_static or GPU_MEM_FRACTION))
            tokens = int(budget // per_token)
        else:
            budget = min(_available_host_bytes() * (args.mem_fraction_static or CPU_MEM_FRACTION), CPU_KV_CAP_BYTES)
            needed = self.max_running_requests * self.context_length
            tokens = min(int(budget // per_token), needed)
        tokens -= tokens % self.page_size
        if tokens < max(16, self.page_size):
            raise ValueError(f"not enough memory for the KV cache: room for {tokens} tokens "
                             f"({per_token} bytes each); lower the model size or raise mem_fraction_static")
        return tokens

    @torch.inference_mode()
    def forward(self, forward_batch: ForwardBatch) -> torch.Tensor:
        """Logits [L, vocab] float32 for `forward_batch.logits_indices` (default: each request's last token)."""
        self.attn_backend.init_forward_metadata(forward_batch)
        return self.model(forward_batch)


    # -- RL hooks (the scheduler calls these only while no request runs) ----------------------
    def update_weights_from_disk(self, model_path: str) -> None:
        """Load the weights at `model_path` in place of the current ones. The new model must
        have the same architecture and shapes; on any failure the current weights stay."""
        path = resolve_model_path(model_path)
        config = load_model_config(path, self.server_args.context_length)
        mismatch = _shape_mismatch(self.model_config, config)
        if mismatch:
            raise ValueError(f"model {model_path!r} does not fit the loaded one: {mismatch}")
        old_path, self.model_path = self.model_path, path
        try:
            model = self._load_model()
        except Exception:
            self.model_path = old_path
            raise
        model.attn_backend = self.attn_backend
        self.model = model

    def release_memory(self, weights: bool = True, kv_cache: bool = True) -> None:
        """Free the weights and/or the KV tensors; `resume_memory` re-creates them."""
        if weights:
            self.model = None
        if kv_cache:
            self.token_to_kv_pool.release()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def resume_memory(self, weights: bool = True, kv_cache: bool = True) -> None:
        if kv_cache and self.token_to_kv_pool.released:
            self.token_to_kv_pool.allocate()
        if weights and self.model is None:
            model = self._load_model()  # the current model_path: updated weights stay updated
            model.attn_backend = self.attn_backend
            self.model = model


    def embed(self, prompts: List[List[int]], pooling: str) -> List[List[float]]:
        """Normalized pooled embeddings of `prompts` (model_executor/embedding.py)."""
        from lmprog_runtime.model_executor.embedding import pooled_embedding

        if self.model is None:
            raise RuntimeError("the weights are released (/resume_memory_occupation first)")
        return [pooled_embedding(self.model, ids, self.device, pooling) for ids in prompts]


_SHAPE_FIELDS = ("architecture", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                 "head_dim", "intermediate_size", "tie_word_embeddings", "attention_bias")


def _shape_mismatch(old: ModelConfig, new: ModelConfig) -> str:
    """'' when `new` can replace `old` in place, else the fields that differ."""
    diffs = [f"{name} {getattr(old, name)!r} vs {getattr(new, name)!r}" for name in _SHAPE_FIELDS
             if getattr(old, name) != getattr(new, name)]
    return ", ".join(diffs)
