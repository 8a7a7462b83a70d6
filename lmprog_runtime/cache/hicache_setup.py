"""Builds the HiCache stack for a scheduler: host pool, tier copies, tiered tree, storage
and controller. Every bad configuration fails here, at start-up, with the reason:
an L2 not larger than L1, an L2 that does not fit in RAM, a bad extra config, an
unwritable storage directory, a storage master that does not answer."""

from __future__ import annotations

import hashlib
import logging
import os
import re

import torch

from lmprog_runtime.cache.allocator import TokenSlotAllocator
from lmprog_runtime.cache.hicache import STORAGE_PAGE_MIN_TOKENS, HiCacheConfig, HiCacheController
from lmprog_runtime.cache.hiradix import HiRadixCache
from lmprog_runtime.cache.host_pool import HostKVPool, TierIO
from lmprog_runtime.cache.kv_pool import TokenToKVPool

logger = logging.getLogger(__name__)

HOST_MEMORY_FRACTION = 0.9  # of the available RAM the host pool may take


def storage_page_tokens(page_size: int) -> int:
    """The L3 page: whole KV pages, at least STORAGE_PAGE_MIN_TOKENS tokens."""
    return -(-STORAGE_PAGE_MIN_TOKENS // page_size) * page_size


def host_pool_tokens(args, device_tokens: int, per_token: int, page_size: int) -> int:
    tokens = int(args.hicache_size * 1e9 // per_token) if args.hicache_size > 0 else int(
        device_tokens * args.hicache_ratio)
    tokens -= tokens % page_size
    if tokens <= device_tokens:
        raise ValueError(f"HiCache: the host pool (L2, {tokens} tokens from hicache_size={args.hicache_size} "
                         f"GB / hicache_ratio={args.hicache_ratio}) must be larger than the device pool "
                         f"(L1, {device_tokens} tokens); raise --hicache-size or --hicache-ratio")
    return tokens


def _check_fits(tokens: int, per_token: int) -> None:
    import psutil
    need, have = tokens * per_token, psutil.virtual_memory().available * HOST_MEMORY_FRACTION
    if need > have:
        raise ValueError(f"HiCache: the host pool needs {need / 1e9:.2f} GB ({tokens} tokens x {per_token} "
                         f"bytes) but only {have / 1e9:.2f} GB of RAM is available; lower --hicache-size "
                         f"or --hicache-ratio")


def resolved_io_backend(args, dev_pool) -> str:
    """`--hicache-io-backend`, unset: layer-wise (`kernel`) on a GPU, whole copies (`direct`) on a
    CPU, where the copy thread competes with the forward for the same cores (docs/hicache.md)."""
    if args.hicache_io_backend is not None:
        return args.hicache_io_backend
    return "kernel" if dev_pool.k.device.type == "cuda" else "direct"


def model_tag(model_path: str, cfg, dtype: torch.dtype, page_tokens: int) -> str:
    """Names one KV layout in storage keys: pages of another model or format never match."""
    name = re.sub(r"[^A-Za-z0-9.-]+", "-", os.path.basename(os.path.normpath(str(model_path))))[:40]
    layout = f"{model_path}|{cfg.num_layers}|{cfg.num_kv_heads}|{cfg.head_dim}|{dtype}|{page_tokens}"
    return f"{name}-{hashlib.sha256(layout.encode()).hexdigest()[:12]}"


def build_hicache(args, runner, allocator: TokenSlotAllocator, page_size: int):
    """(HiRadixCache, HiCacheController) over `runner`'s device pool and `allocator`."""
    config = HiCacheConfig.parse(args.hicache_storage_backend_extra_config)
    cfg, dev_pool = runner.model_config, runner.token_to_kv_pool
    dtype = dev_pool.k.dtype if args.hicache_host_dtype == "auto" else getattr(torch, args.hicache_host_dtype)
    per_token = TokenToKVPool.bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype)
    tokens = host_pool_tokens(args, allocator.size, per_token, page_size)
    _check_fits(tokens, per_token)
    S = storage_page_tokens(page_size)
    storage = None
    if args.hicache_storage_backend is not None:
        from lmprog_runtime.cache.storage import create_storage
        storage = create_storage(args.hicache_storage_backend, model_tag(runner.model_path, cfg, dtype, S),
                                 args, config)
    host = HostKVPool(tokens, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype, page_size,
                      pin=dev_pool.k.device.type == "cuda")
    io = TierIO(dev_pool, host, layerwise=resolved_io_backend(args, dev_pool) == "kernel")
    io.calibrate()
    tree = HiRadixCache(allocator, TokenSlotAllocator(tokens, page_size), io, page_size, args.hicache_write_policy)
    logger.info("HiCache: L2 %d tokens (%s, %.2f GB), write policy %s, L3 %s, host->device %.2f GB/s, %s",
                tokens, dtype, tokens * per_token / 1e9, args.hicache_write_policy,
                args.hicache_storage_backend or "off", io.load_bytes_per_s / 1e9,
                "layer-wise load-back" if io.loads is not None else "whole load-back")
    controller = HiCacheController(tree, io, storage, S, args.hicache_storage_prefetch_policy, config)
    return tree, controller
