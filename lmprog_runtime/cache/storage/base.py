"""The L3 contract (SGLang's `HiCacheStorage`): pages of KV by key, batched get/set/exists.

A key is the SHA-256 page-hash chain of the page's tokens: page i's key is
`sha256(bytes.fromhex(key[i-1]) || token ids as uint32 little-endian)` in hex, and the
chain is seeded by the namespace (`cache_salt`, `extra_key`): page 0's prior is
`sha256(repr(namespace))` when there is one, nothing otherwise. So a key names a page
*and* everything before it, and two namespaces never share a key.

A value is one page's bytes (`TierIO.page_bytes`: K then V of every layer, host dtype).
Implementations are thread-safe: the prefetch and write workers call them concurrently.
"""

from __future__ import annotations

import hashlib
import struct
from abc import ABC, abstractmethod
from typing import Hashable, List, Optional, Sequence


def page_hashes(token_ids: Sequence[int], page_tokens: int, namespace: Hashable = None) -> List[str]:
    """Keys of the whole pages of `token_ids` (a trailing partial page has none)."""
    prior = b"" if namespace is None else hashlib.sha256(repr(namespace).encode()).digest()
    keys = []
    for start in range(0, len(token_ids) - page_tokens + 1, page_tokens):
        page = token_ids[start:start + page_tokens]
        digest = hashlib.sha256(prior + struct.pack(f"<{len(page)}I", *page)).digest()
        keys.append(digest.hex())
        prior = digest
    return keys


class HiCacheStorage(ABC):
    @abstractmethod
    def get(self, key: str) -> Optional[bytes]:
        """The page stored under `key`, or None."""

    @abstractmethod
    def set(self, key: str, value: bytes) -> bool:
        """Store one page; False when it could not be stored."""

    @abstractmethod
    def exists(self, key: str) -> bool:
        ...

    def batch_get(self, keys: List[str]) -> List[Optional[bytes]]:
        return [self.get(k) for k in keys]

    def batch_set(self, keys: List[str], values: List[bytes]) -> List[bool]:
        return [self.set(k, v) for k, v in zip(keys, values)]

    def batch_exists(self, keys: List[str]) -> int:
        """How many leading keys are stored (a chain is only usable up to its first gap)."""
        for i, k in enumerate(keys):
            if not self.exists(k):
                return i
        return len(keys)

    def capacity_bytes(self) -> Optional[int]:
        """How many page bytes this backend keeps (None: not known)."""
        return None

    @abstractmethod
    def clear(self) -> None:
        """Drop every page of this model layout."""

    def close(self) -> None:
        pass
