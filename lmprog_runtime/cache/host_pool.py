"""The L2 host KV pool of HiCache and the copies between tiers.

`HostKVPool` has the device pool's layout, `k`/`v` [layers, slots + page_size, kv_heads,
head_dim], in host memory (pinned where the device is a GPU), optionally in a smaller
dtype: a copy converts with `Tensor.to` (float32 → bfloat16 rounds to nearest even, the
way back is exact). Its slots are handed out by a second `TokenSlotAllocator`.

`TierIO` moves KV between slots of the two pools and turns host slots into page bytes
for the L3 storage (and back). It counts the bytes it moved (`stats`) and measures the
host → device bandwidth once at start-up (`calibrate`), which the load-back decision needs.
"""

from __future__ import annotations

import time

import torch

from lmprog_runtime.cache.kv_pool import TokenToKVPool


class HostKVPool:
    def __init__(self, num_slots: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, page_size: int = 1, pin: bool = False):
        self.size = num_slots
        self.dtype = dtype
        self.page_size = page_size
        shape = (num_layers, num_slots + page_size, num_kv_heads, head_dim)  # page 0 = padding
        self.k = torch.zeros(shape, dtype=dtype, pin_memory=pin)
        self.v = torch.zeros(shape, dtype=dtype, pin_memory=pin)
        self.bytes_per_token = TokenToKVPool.bytes_per_token(num_layers, num_kv_heads, head_dim, dtype)


def _index(slots: torch.Tensor, device) -> torch.Tensor:
    return slots.to(device=device, dtype=torch.int64)


class TierIO:
    """Copies between the device pool (`TokenToKVPool`) and the host pool, slot lists in
    matching order (int64 [n] each)."""

    def __init__(self, device_pool, host_pool: HostKVPool):
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.stats = {"l2_write_bytes": 0, "l2_load_bytes": 0}
        self.load_bytes_per_s = 0.0  # measured host → device bandwidth (0: not measured)

    def device_to_host(self, dev_slots: torch.Tensor, host_slots: torch.Tensor) -> None:
        d, h = self.device_pool, self.host_pool
        di, hi = _index(dev_slots, d.k.device), _index(host_slots, "cpu")
        for src, dst in ((d.k, h.k), (d.v, h.v)):
            dst.index_copy_(1, hi, src.index_select(1, di).to(device="cpu", dtype=h.dtype))
        self.stats["l2_write_bytes"] += len(host_slots) * h.bytes_per_token

    def host_to_device(self, host_slots: torch.Tensor, dev_slots: torch.Tensor) -> None:
        d, h = self.device_pool, self.host_pool
        di, hi = _index(dev_slots, d.k.device), _index(host_slots, "cpu")
        for src, dst in ((h.k, d.k), (h.v, d.v)):
            dst.index_copy_(1, di, src.index_select(1, hi).to(device=dst.device, dtype=dst.dtype,
                                                              non_blocking=True))
        if d.k.device.type == "cuda":
            torch.cuda.current_stream(d.k.device).synchronize()
        self.stats["l2_load_bytes"] += len(host_slots) * h.bytes_per_token

    # -- pages for L3: k then v, each [layers, tokens, kv_heads, head_dim], host dtype ---------
    def page_bytes(self, host_slots: torch.Tensor) -> bytes:
        h, hi = self.host_pool, _index(host_slots, "cpu")
        both = torch.stack([h.k.index_select(1, hi), h.v.index_select(1, hi)])
        return both.contiguous().view(torch.uint8).numpy().tobytes()

    def page_nbytes(self, num_tokens: int) -> int:
        return num_tokens * self.host_pool.bytes_per_token

    def write_page(self, host_slots: torch.Tensor, data: bytes) -> None:
        """Fill `host_slots` from `page_bytes` output (the caller checked the length)."""
        h, hi = self.host_pool, _index(host_slots, "cpu")
        shape = (2, h.k.shape[0], len(host_slots), *h.k.shape[2:])
        both = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(h.dtype).view(shape)
        h.k.index_copy_(1, hi, both[0])
        h.v.index_copy_(1, hi, both[1])

    def calibrate(self, tokens: int = 256, repeats: int = 3) -> float:
        """Host → device bytes/s over `tokens` slots (the padding page's neighbours are
        overwritten and zeroed again: nothing is allocated at start-up)."""
        d, h = self.device_pool, self.host_pool
        n = min(tokens, d.size, h.size)
        slots = torch.arange(h.page_size, h.page_size + n, dtype=torch.int64)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            self.host_to_device(slots, slots)
            best = min(best, time.perf_counter() - t0)
        for pool in (d, h):
            pool.k[:, slots] = 0
            pool.v[:, slots] = 0
        self.stats["l2_load_bytes"] = 0
        self.load_bytes_per_s = n * h.bytes_per_token / max(best, 1e-9)
        return self.load_bytes_per_s
