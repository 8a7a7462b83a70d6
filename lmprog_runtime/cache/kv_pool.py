"""The paged KV memory: the per-request slot table and the per-token K/V tensors.

Slot 0 of the token pool is reserved (padding writes land there); row 0 of the
request table likewise. Both pools only hand out indices; the allocator in
`allocator.py` owns which token slots are free.
"""

from __future__ import annotations

import math
from typing import List

import torch


class ReqToTokenPool:
    """`table[row, pos]` = KV slot of position `pos` of the request that holds `row`."""

    def __init__(self, max_reqs: int, max_context: int, device="cpu"):
        self.size = max_reqs
        self.max_context = max_context
        self.table = torch.zeros((max_reqs + 1, max_context), dtype=torch.int64, device=device)
        self._free_rows: List[int] = list(range(1, max_reqs + 1))

    def alloc(self) -> int:
        if not self._free_rows:
            raise RuntimeError("ReqToTokenPool is out of rows")
        return self._free_rows.pop()

    def free(self, row: int) -> None:
        assert 0 < row <= self.size and row not in self._free_rows, row
        self._free_rows.append(row)

    def available_size(self) -> int:
        return len(self._free_rows)

    def clear(self) -> None:
        self._free_rows = list(range(1, self.size + 1))


LAZY_ZERO_BYTES = 64 << 20  # CPU pools at least this large rely on the OS's zero pages


class TokenToKVPool:
    """K and V for every layer: `k[layer]` is [num_slots + page_size, kv_heads, head_dim]."""

    def __init__(self, num_slots: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device="cpu", page_size: int = 1):
        self.size = num_slots
        self.num_layers = num_layers
        self.shape = (num_layers, num_slots + page_size, num_kv_heads, head_dim)  # page 0 = padding
        self.dtype, self.device, self.page_size = dtype, device, page_size
        self.load_gate = None  # HiCache's LayerLoads when load-backs overlap the forward
        self.allocate()

    def allocate(self) -> None:
        """(Re)create the K/V tensors, every slot finite (zero) until written.

        Masked attention still multiplies the values it reads, so every slot must hold finite
        numbers. On the CPU an allocation above glibc's largest mmap threshold (32 MiB) comes
        straight from the OS as zero pages, faulted in on first write (zero-filling gigabytes up
        front cost 2.5 s of every start); smaller ones and device memory may hold anything."""
        nbytes = math.prod(self.shape) * torch.tensor([], dtype=self.dtype).element_size()
        lazy = torch.device(self.device).type == "cpu" and nbytes >= LAZY_ZERO_BYTES
        alloc = torch.empty if lazy else torch.zeros
        self.k = alloc(self.shape, dtype=self.dtype, device=self.device)
        self.v = alloc(self.shape, dtype=self.dtype, device=self.device)
        self.k[:, :self.page_size].zero_()
        self.v[:, :self.page_size].zero_()

    def release(self) -> None:
        """Free the K/V tensors (their slots hold nothing until `allocate`)."""
        self.k = self.v = None

    @property
    def released(self) -> bool:
        return self.k is None

    def set_kv(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # loc [T]; k, v [T, kv_heads, head_dim]. Every attention backend calls this for a layer
        # before reading it: layer-wise load-backs in flight must have copied it first.
        if self.load_gate is not None:
            self.load_gate.wait(layer)
        self.k[layer].index_copy_(0, loc, k.to(self.k.dtype))
        self.v[layer].index_copy_(0, loc, v.to(self.v.dtype))

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """K/V of slots `src` [n] to slots `dst` [n] in every layer (all sources read first)."""
        src, dst = src.to(self.k.device), dst.to(self.k.device)
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()
