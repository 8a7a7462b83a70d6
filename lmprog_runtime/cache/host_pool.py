"""The L2 host KV pool of HiCache and the copies between tiers.

`HostKVPool` has the device pool's layout, `k`/`v` [layers, slots + page_size, kv_heads,
head_dim], in host memory (pinned where the device is a GPU), optionally in a smaller
dtype: a copy converts with `Tensor.to` (float32 → bfloat16 rounds to nearest even, the
way back is exact). Its slots are handed out by a second `TokenSlotAllocator`.

`TierIO` moves KV between slots of the two pools and turns host slots into page bytes
for the L3 storage (and back). It counts the bytes it moved (`stats`) and measures the
host → device bandwidth once at start-up (`calibrate`), which the load-back decision needs.
With `layerwise` (`--hicache-io-backend kernel`) a host → device load returns at once and
copies layer by layer on a copy thread (`layer_loads.LayerLoads`), the forward waiting per
layer; every other copy drains those loads first. Without it (`direct`) it copies all
layers before returning.
"""

from __future__ import annotations

import time

import torch

from lmprog_runtime.cache.kv_pool import TokenToKVPool
from lmprog_runtime.cache.layer_loads import LayerLoads


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

    def __init__(self, device_pool, host_pool: HostKVPool, layerwise: bool = False):
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.stats = {"l2_write_bytes": 0, "l2_load_bytes": 0}
        self.load_bytes_per_s = 0.0  # measured host → device bandwidth (0: not measured)
        self.loads = LayerLoads(host_pool.k.shape[0]) if layerwise else None
        device_pool.load_gate = self.loads
        self._copy_stream = None  # on a GPU: the copy thread's own CUDA stream

    def drain(self) -> None:
        """Wait for the layer-wise loads in flight (before touching their slots otherwise)."""
        if self.loads is not None:
            self.loads.drain()

    def close(self) -> None:
        if self.loads is not None:
            self.loads.drain()
            self.loads.close()
            self.device_pool.load_gate = None

    def device_to_host(self, dev_slots: torch.Tensor, host_slots: torch.Tensor) -> None:
        self.drain()
        d, h = self.device_pool, self.host_pool
        di, hi = _index(dev_slots, d.k.device), _index(host_slots, "cpu")
        for layer in range(h.k.shape[0]):  # per layer: a row gather, several times faster than dim 1 of 4
            for src, dst in ((d.k, h.k), (d.v, h.v)):
                dst[layer].index_copy_(0, hi, src[layer].index_select(0, di).to(device="cpu", dtype=h.dtype))
        self.stats["l2_write_bytes"] += len(host_slots) * h.bytes_per_token

    def host_to_device(self, host_slots: torch.Tensor, dev_slots: torch.Tensor) -> None:
        """Copy host slots into device slots: now, or (layerwise) queued for the copy thread."""
        d, h = self.device_pool, self.host_pool
        di, hi = _index(dev_slots, d.k.device), _index(host_slots, "cpu")
        self.stats["l2_load_bytes"] += len(host_slots) * h.bytes_per_token
        if self.loads is not None:
            ready = None
            if d.k.device.type == "cuda":  # `di` was made on this thread's stream: the copy stream waits for it
                ready = torch.cuda.Event()
                ready.record(torch.cuda.current_stream(d.k.device))
            self.loads.submit(lambda layer: self._copy_layer(layer, hi, di, ready))
            return
        for layer in range(h.k.shape[0]):
            self._copy_layer_on(layer, hi, di)
        if d.k.device.type == "cuda":
            torch.cuda.current_stream(d.k.device).synchronize()

    def _copy_layer(self, layer: int, hi: torch.Tensor, di: torch.Tensor, ready=None) -> None:
        """Copy thread: one layer of one load (on a GPU, on the copy thread's own stream,
        after `ready`, and synchronized before the layer counts as copied)."""
        d = self.device_pool
        if d.k.device.type != "cuda":
            return self._copy_layer_on(layer, hi, di)
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(d.k.device)
        with torch.cuda.stream(self._copy_stream):
            if layer == 0 and ready is not None:
                self._copy_stream.wait_event(ready)
            self._copy_layer_on(layer, hi, di)
        self._copy_stream.synchronize()

    def _copy_layer_on(self, layer: int, hi: torch.Tensor, di: torch.Tensor) -> None:
        d, h = self.device_pool, self.host_pool
        for src, dst in ((h.k, d.k), (h.v, d.v)):
            rows = src[layer].index_select(0, hi).to(device=dst.device, dtype=dst.dtype, non_blocking=True)
            dst[layer].index_copy_(0, di, rows)

    # -- pages for L3: k then v, each [layers, tokens, kv_heads, head_dim], host dtype ---------
    def page_bytes(self, host_slots: torch.Tensor) -> bytes:
        h, hi = self.host_pool, _index(host_slots, "cpu")
        both = torch.stack([h.k.index_select(1, hi), h.v.index_select(1, hi)])
        return both.contiguous().view(torch.uint8).numpy().tobytes()

    def page_nbytes(self, num_tokens: int) -> int:
        return num_tokens * self.host_pool.bytes_per_token

    def write_page(self, host_slots: torch.Tensor, data: bytes) -> None:
        """Fill `host_slots` from `page_bytes` output (the caller checked the length); any
        thread (the prefetch worker): freshly allocated host slots may still be a load's source."""
        self.drain()
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
            self.drain()
            best = min(best, time.perf_counter() - t0)
        for pool in (d, h):
            pool.k[:, slots] = 0
            pool.v[:, slots] = 0
        self.stats["l2_load_bytes"] = 0
        self.load_bytes_per_s = n * h.bytes_per_token / max(best, 1e-9)
        return self.load_bytes_per_s
