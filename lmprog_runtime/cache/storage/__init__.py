"""L3 storage backends of HiCache behind one contract (`base.HiCacheStorage`); the
factory imports a backend only when it is chosen."""

from __future__ import annotations

from lmprog_runtime.cache.storage.base import HiCacheStorage, page_hashes

__all__ = ["HiCacheStorage", "create_storage", "page_hashes"]


def create_storage(name: str, model_tag: str, args, extra: dict) -> HiCacheStorage:
    """The backend `name` for pages of one model layout (`model_tag`); raises ValueError with
    the reason when it cannot start (unwritable directory, master not reachable, ...)."""
    if name == "file":
        from lmprog_runtime.cache.storage.file import HiCacheFile
        return HiCacheFile(args.resolved_hicache_storage_dir, model_tag,
                           max_bytes=int(args.hicache_storage_max_gb * 1e9))
    if name == "mooncake":
        from lmprog_runtime.cache.storage.mooncake import HiCacheMooncake
        return HiCacheMooncake(model_tag, extra)
    raise ValueError(f"hicache_storage_backend must be one of ['file', 'mooncake'], got {name!r}")
