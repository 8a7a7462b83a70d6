"""Attention backends behind one contract (`base.AttentionBackend`), chosen by name.

Implementations are imported only when chosen, so `triton` / `flashinfer` are never
imported on a machine that does not use them.
"""

from __future__ import annotations

import importlib

from lmprog_runtime.attention.base import AttentionBackend

# name -> "module:Class"
BACKENDS = {
    "torch_native": "lmprog_runtime.attention.torch_native:TorchNativeAttnBackend",
    "triton": "lmprog_runtime.attention.triton:TritonAttnBackend",
    "flashinfer": "lmprog_runtime.attention.flashinfer:FlashInferAttnBackend",
}


def create_attention_backend(name: str, **kwargs) -> AttentionBackend:
    """Build backend `name`; kwargs are `AttentionBackend.__init__`'s
    (token_to_kv_pool, num_heads, num_kv_heads, head_dim, scaling)."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; expected one of {sorted(BACKENDS)}")
    module_name, class_name = BACKENDS[name].split(":")
    try:
        module = importlib.import_module(module_name)
        cls = getattr(module, class_name)
    except ModuleNotFoundError as e:
        why = "not implemented yet" if e.name == module_name else str(e)
        raise ImportError(f"attention backend {name!r} is not available: {why}") from e
    except (ImportError, AttributeError) as e:
        raise ImportError(f"attention backend {name!r} is not available: {e}") from e
    return cls(**kwargs)


__all__ = ["AttentionBackend", "BACKENDS", "create_attention_backend"]
