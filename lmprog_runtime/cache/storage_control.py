"""Attach, detach and show HiCache's L3 storage backend at run time (SGLang's
`PUT|DELETE|GET /hicache/storage-backend`), inside the scheduler.

Attach and detach run only while the scheduler is idle (nothing running, waiting or
compiling a grammar): a prefetch or write in flight would otherwise straddle the switch.
A refused or invalid request changes nothing. `code` in a failed reply's data is the
HTTP status: 400 (invalid, or HiCache off), 409 (busy).

Attach takes SGLang's fields (`hicache_storage_backend`, `hicache_storage_backend_extra_config_json`,
`hicache_storage_prefetch_policy`) plus lmprog's `hicache_storage_dir` for the file backend,
and checks them the way the start-up flags are checked (ServerArgs, HiCacheConfig, the
backend's own start-up checks). Detach stops the prefetch and write workers after the
queued writes, and the tree forgets its storage-only nodes; the pages stay in the backend.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional

from lmprog_runtime.messages import ControlReply, HiCacheStorageReq

logger = logging.getLogger(__name__)

KIND = "hicache_storage"


class StorageControl:
    def __init__(self, args, runner, kv):
        self.args = args   # ServerArgs as now in effect for L3 (replaced on attach/detach)
        self.runner = runner
        self.kv = kv

    def handle(self, msg: HiCacheStorageReq, busy: Optional[str]) -> ControlReply:
        """`busy`: why the scheduler is not idle (None when it is)."""
        if msg.op == "status":
            return ControlReply(KIND, data=self.status())
        hicache = self.kv.hicache
        if hicache is None:
            return _fail("HiCache is off: start the server with --enable-hierarchical-cache "
                         "to attach a storage backend.", 400)
        if busy is not None:
            return _fail(f"Reject {msg.op}: scheduler is not idle ({busy}); retry when it is.", 409)
        if msg.op == "detach":
            return self._detach(hicache)
        return self._attach(hicache, msg)

    def status(self) -> dict:
        a = self.args
        file_dir = a.resolved_hicache_storage_dir if a.hicache_storage_backend == "file" else None
        return {"hicache_storage_backend": a.hicache_storage_backend,
                "hicache_storage_backend_extra_config": a.hicache_storage_backend_extra_config,
                "hicache_storage_prefetch_policy": a.hicache_storage_prefetch_policy,
                "hicache_storage_dir": file_dir,
                "enable_hierarchical_cache": a.enable_hierarchical_cache}

    def _detach(self, hicache) -> ControlReply:
        name = self.args.hicache_storage_backend
        if name is None:
            return ControlReply(KIND, message="No storage backend is attached.", data=self.status())
        hicache.detach()
        self.args = dataclasses.replace(self.args, hicache_storage_backend=None)
        logger.info("HiCache: storage backend %s detached", name)
        return ControlReply(KIND, message=f"Detached HiCache storage backend {name!r}.", data=self.status())

    def _attach(self, hicache, msg: HiCacheStorageReq) -> ControlReply:
        if self.args.hicache_storage_backend is not None:
            return _fail(f"A storage backend ({self.args.hicache_storage_backend!r}) is already attached; "
                         "DELETE /hicache/storage-backend first.", 400)
        from lmprog_runtime.cache.hicache import HiCacheConfig
        from lmprog_runtime.cache.hicache_setup import model_tag
        from lmprog_runtime.cache.storage import create_storage

        try:
            args = dataclasses.replace(
                self.args, hicache_storage_backend=msg.backend,
                hicache_storage_backend_extra_config=msg.extra_config,
                hicache_storage_prefetch_policy=msg.prefetch_policy or self.args.hicache_storage_prefetch_policy,
                hicache_storage_dir=msg.storage_dir or self.args.hicache_storage_dir)
            config = HiCacheConfig.parse(args.hicache_storage_backend_extra_config)
            dtype, S = hicache.io.host_pool.dtype, hicache.page_tokens
            tag = model_tag(self.runner.model_path, self.runner.model_config, dtype, S)
            storage = create_storage(args.hicache_storage_backend, tag, args, config)
        except ValueError as e:
            return _fail(f"Not attached: {e}", 400)
        hicache.attach(storage, args.hicache_storage_prefetch_policy, config)
        self.args = args
        logger.info("HiCache: storage backend %s attached", msg.backend)
        return ControlReply(KIND, message=f"Attached HiCache storage backend {msg.backend!r}.", data=self.status())


def _fail(message: str, code: int) -> ControlReply:
    return ControlReply(KIND, success=False, message=message, data={"code": code})
