"""Free-list allocator of KV token slots, page by page.

With page_size P there are size // P pages, numbered 1..size // P; page p holds slots
[p*P, p*P + P), so the slots handed out are P..size + P - 1 and page 0 (slots 0..P-1,
slot 0 being the padding slot) is never used. Slot s belongs to page s // P; pages are
handed out whole, so `alloc(n)` needs n to be a multiple of P, and `free` takes back
whole pages (every slot of a page at once).
"""

from __future__ import annotations

import torch


class TokenSlotAllocator:
    def __init__(self, size: int, page_size: int = 1, device="cpu"):
        assert size % page_size == 0, (size, page_size)
        self.size = size
        self.page_size = page_size
        self.device = device
        self.clear()

    def clear(self) -> None:
        # Pages 1..num_pages; page p holds slots [p*P, p*P + P). Slot 0..P-1 (page 0) is never used.
        self.num_pages = self.size // self.page_size
        self._free_pages = torch.arange(1, self.num_pages + 1, dtype=torch.int64)
        self._released: list = []

    def available_size(self) -> int:
        return (len(self._free_pages) + sum(len(r) for r in self._released)) * self.page_size

    def _merge(self) -> None:
        if self._released:
            self._free_pages = torch.cat([self._free_pages, *self._released])
            self._released = []

    def alloc(self, num_tokens: int):
        """Return `num_tokens` slot indices (whole pages), or None when there is not enough room."""
        assert num_tokens % self.page_size == 0, (num_tokens, self.page_size)
        need = num_tokens // self.page_size
        if need > len(self._free_pages):
            self._merge()
            if need > len(self._free_pages):
                return None
        pages, self._free_pages = self._free_pages[:need], self._free_pages[need:]
        if self.page_size == 1:
            return pages.clone()
        offsets = torch.arange(self.page_size, dtype=torch.int64)
        return (pages[:, None] * self.page_size + offsets[None, :]).reshape(-1)

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel() == 0:
            return
        slots = slots.to(torch.int64).cpu()
        pages = slots if self.page_size == 1 else torch.unique(slots // self.page_size)
        self._released.append(pages)
