"""Converted weights kept on disk, so a warm start skips GGUF dequantization and repacking.

A GGUF model's weights, once loaded into our modules (dense, or packed by `quantize_model`),
are saved as one safetensors file next to its converted config and tokenizer (the folder is
keyed by the GGUF's path, size and mtime), and the file name is keyed by everything that
shapes the tensors: format, kernel dtype, dense crossover, dense dtype, torch version.
Loading reads the file memory-mapped into a model built on the meta device. Any unreadable,
partial or mismatching file is ignored and rebuilt; a read-only cache only costs the
conversion next time.
"""

from __future__ import annotations

import hashlib
import logging
import os
from typing import Optional

import torch
from torch import nn

logger = logging.getLogger(__name__)

CACHE_VERSION = 4  # bump when the module layout or the packing changes (3: qdot.c weights in groups of 8 rows;
# 4: the dense copies beside qdot.c's int4 weights were read in its interleaved row order)
KEEP_FILES = 2  # converted-weight files kept per model file (most recently used first)


def cache_file(model_path: str, formats, dtype: torch.dtype) -> Optional[str]:
    """Where converted weights for this model file and format live; None for HF folders."""
    from lmprog_runtime.model_paths import gguf_cache_dir as _gguf_cache_dir, is_gguf

    if not is_gguf(model_path):
        return None  # safetensors checkpoints already load memory-mapped
    # dense_rows itself is a runtime threshold; only whether dense copies exist shapes the file
    from lmprog_runtime.model_executor import qgemm

    key = repr((CACHE_VERSION, torch.__version__, formats.quant, str(formats.act_dtype),
                formats.dense_rows is not None, str(dtype), str(formats.dense_weight_dtype), qgemm.available(),  # native int4 layout
                formats.quant is not None and qgemm.dot_available()))  # int8 activations: float16 int4 scales
    name = "weights-" + hashlib.sha256(key.encode()).hexdigest()[:16] + ".safetensors"
    return os.path.join(_gguf_cache_dir(model_path), name)


def load(build_meta, path: Optional[str]) -> Optional[nn.Module]:
    """`build_meta()` (a model on the meta device, quantized structure included) filled from
    `path`, or None when there is no usable file."""
    if path is None or not os.path.isfile(path):
        return None
    from safetensors.torch import load_file

    try:
        state = {k: _aligned(k, v) for k, v in load_file(path).items()}
        model = build_meta()
        model.load_state_dict(state, strict=True, assign=True)
    except Exception as e:  # stale or partial: convert again and overwrite
        logger.warning("ignoring cached weights %s: %s", path, e)
        return None
    try:
        os.utime(path)  # most recently used: kept by _prune
    except OSError:
        pass
    return model.eval()


def _aligned(name: str, t: torch.Tensor) -> torch.Tensor:
    """Tensors read from the file sit at the header's offset (not 64-byte aligned); torch's
    packed int8/int4 CPU kernels crash on such buffers, so those few are copied."""
    packed = name.endswith((".qweight", ".scales", ".scale_zeros"))
    return t.clone() if packed and t.data_ptr() % 64 else t


def save(model: nn.Module, path: Optional[str]) -> None:
    """Write `model`'s state atomically to `path` (best effort)."""
    if path is None:
        return
    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        save_file(state, tmp)
        os.replace(tmp, path)
        _prune(os.path.dirname(path))
    except OSError as e:
        logger.info("not caching converted weights at %s: %s", path, e)
        try:
            os.remove(tmp)
        except OSError:
            pass


def _prune(folder: str) -> None:
    """Delete all but the KEEP_FILES most recently used converted-weight files (hundreds of MB each)."""
    files = sorted((os.path.join(folder, f) for f in os.listdir(folder)
                    if f.startswith("weights-") and f.endswith(".safetensors")), key=os.path.getmtime, reverse=True)
    for stale in files[KEEP_FILES:]:
        try:
            os.remove(stale)
        except OSError:
            pass
