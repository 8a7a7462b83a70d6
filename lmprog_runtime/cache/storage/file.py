"""`file` backend: one file per page, `<key>_<model_tag>_0_1.bin` (SGLang's
`<hash>_<model>_<tp_rank>_<tp_size>.bin`), under one directory, with an LRU size limit.

Writes go to a temporary name and are renamed into place, so a reader (this process or
another server sharing the directory) sees a whole page or none. The LRU index is built
from the directory at start (by modification time) and kept in memory; a read refreshes
a page's time. Several servers may share a directory; each enforces the limit on the
pages it knows of.
"""

from __future__ import annotations

import os
import tempfile
import threading
from collections import OrderedDict
from typing import Optional

from lmprog_runtime.cache.storage.base import HiCacheStorage


class HiCacheFile(HiCacheStorage):
    def __init__(self, directory: str, model_tag: str, max_bytes: int):
        self.directory = directory
        self.suffix = f"_{model_tag}_0_1.bin"
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._lru: "OrderedDict[str, int]" = OrderedDict()  # key -> file bytes, oldest first
        self._bytes = 0
        self._check_writable()
        self._scan()

    def _check_writable(self) -> None:
        try:
            os.makedirs(self.directory, exist_ok=True)
            fd, probe = tempfile.mkstemp(prefix=".probe-", dir=self.directory)
            os.close(fd)
            os.remove(probe)
        except OSError as e:
            raise ValueError(f"hicache_storage_dir {self.directory!r} is not a writable directory "
                             f"({type(e).__name__}: {e}); pass a writable --hicache-storage-dir "
                             f"(or SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR)") from e

    def _scan(self) -> None:
        found = []
        with os.scandir(self.directory) as entries:
            for e in entries:
                if e.name.endswith(self.suffix) and e.is_file():
                    st = e.stat()
                    found.append((st.st_mtime, e.name[:-len(self.suffix)], st.st_size))
        for _, key, size in sorted(found):
            self._lru[key] = size
            self._bytes += size

    def _path(self, key: str) -> str:
        return os.path.join(self.directory, key + self.suffix)

    def get(self, key: str) -> Optional[bytes]:
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            with self._lock:
                self._forget(key)
            return None
        with self._lock:
            self._remember(key, len(data))
        try:
            os.utime(path)
        except OSError:
            pass
        return data

    def set(self, key: str, value: bytes) -> bool:
        try:
            fd, tmp = tempfile.mkstemp(prefix=".page-", dir=self.directory)
            with os.fdopen(fd, "wb") as f:
                f.write(value)
            os.replace(tmp, self._path(key))
        except OSError:
            return False
        with self._lock:
            self._remember(key, len(value))
            self._evict()
        return True

    def exists(self, key: str) -> bool:
        if os.path.exists(self._path(key)):  # the directory is the truth: others may write it
            return True
        with self._lock:
            self._forget(key)
        return False

    def clear(self) -> None:
        with self._lock:
            for key in list(self._lru):
                self._unlink(key)
            self._lru.clear()
            self._bytes = 0

    # -- the LRU index (under the lock) -------------------------------------------------------
    def _remember(self, key: str, size: int) -> None:
        self._bytes += size - self._lru.pop(key, 0)
        self._lru[key] = size

    def _forget(self, key: str) -> None:
        self._bytes -= self._lru.pop(key, 0)

    def _evict(self) -> None:
        while self._bytes > self.max_bytes and len(self._lru) > 1:
            key, size = self._lru.popitem(last=False)
            self._bytes -= size
            self._unlink(key)

    def _unlink(self, key: str) -> None:
        try:
            os.remove(self._path(key))
        except FileNotFoundError:
            pass

    def capacity_bytes(self) -> int:
        return self.max_bytes

    @property
    def stored_bytes(self) -> int:
        return self._bytes
