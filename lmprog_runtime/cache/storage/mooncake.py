"""`mooncake` backend: pages in a Mooncake Store, a distributed KV store that several
servers share (PyPI `mooncake-transfer-engine-non-cuda`, which ships `mooncake_master`
and this client; Debian `libibverbs1 librdmacm1 libnuma1`).

Each server joins the store through `mooncake_master` (`master_server_address` in
`--hicache-storage-backend-extra-config`) and lends it `global_segment_size` bytes of
RAM; a page put by one server is readable by every other while its lender is up. Keys
are `<page key>_<model_tag>`, so servers of one model layout share pages and others do
not. docs/hicache.md says how to run the master for real.
"""

from __future__ import annotations

import socket
import threading
from typing import List, Optional

from lmprog_runtime.cache.storage.base import HiCacheStorage

CONNECT_TIMEOUT_S = 3.0


def _check_reachable(address: str) -> None:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=CONNECT_TIMEOUT_S):
            pass
    except (OSError, ValueError) as e:
        raise ValueError(f"hicache mooncake: the master at {address!r} is not reachable "
                         f"({type(e).__name__}: {e}); start `mooncake_master` there or fix "
                         f"master_server_address") from e


class HiCacheMooncake(HiCacheStorage):
    def __init__(self, model_tag: str, config):
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise ValueError("hicache_storage_backend 'mooncake' needs the Mooncake store client: "
                             "pip install 'lmprog[mooncake]' (mooncake-transfer-engine-non-cuda) and the "
                             f"Debian packages libibverbs1 librdmacm1 libnuma1 ({e})") from e
        if not config.master_server_address:
            raise ValueError("hicache mooncake: set master_server_address (host:port of mooncake_master) "
                             "in --hicache-storage-backend-extra-config")
        _check_reachable(config.master_server_address)
        self.store = MooncakeDistributedStore()
        ret = self.store.setup(config.local_hostname, config.metadata_server or "P2PHANDSHAKE",
                               config.global_segment_size, config.local_buffer_size, config.protocol,
                               config.device_name, config.master_server_address)
        if ret != 0:
            raise ValueError(f"hicache mooncake: joining the store at {config.master_server_address!r} "
                             f"failed (setup returned {ret})")
        self.suffix = f"_{model_tag}"
        self._capacity = config.global_segment_size
        self._lock = threading.Lock()
        self._written: set = set()

    def get(self, key: str) -> Optional[bytes]:
        with self._lock:
            data = self.store.get(key + self.suffix)
        return bytes(data) if data else None

    def set(self, key: str, value: bytes) -> bool:
        with self._lock:
            ok = self.store.put(key + self.suffix, value) == 0
        if ok:
            self._written.add(key)
        return ok

    def exists(self, key: str) -> bool:
        with self._lock:
            return self.store.is_exist(key + self.suffix) == 1

    def batch_exists(self, keys: List[str]) -> int:
        with self._lock:
            found = self.store.batch_is_exist([k + self.suffix for k in keys])
        for i, hit in enumerate(found):
            if hit != 1:
                return i
        return len(keys)

    def capacity_bytes(self) -> int:
        return self._capacity  # this server's segment (the shared store may hold more)

    def clear(self) -> None:
        """Remove the pages this server put (the store is shared: others' pages stay)."""
        with self._lock:
            for key in self._written:
                self.store.remove(key + self.suffix)
            self._written.clear()

    def close(self) -> None:
        with self._lock:
            self.store.close()
