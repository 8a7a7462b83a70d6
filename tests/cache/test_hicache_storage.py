"""HiCache L3: the page-hash chain, the `file` backend (batched calls, LRU limit, restart,
unwritable directory), and L3 → L2 prefetch with the three stop policies, through a tree
and controller over real pools."""

import hashlib
import os
import struct
import threading
import time

import pytest

from lmprog_runtime.cache.hicache import HiCacheConfig, HiCacheController
from lmprog_runtime.cache.storage import page_hashes
from lmprog_runtime.cache.storage.file import HiCacheFile

from hicache_helpers import assert_kv, audit, make, put

S = 8  # storage page tokens in these tests


def test_page_hash_chain_is_sglangs_sha256_chain():
    tokens = list(range(1000, 1020))
    keys = page_hashes(tokens, 8)
    assert len(keys) == 2  # the trailing partial page has no key
    first = hashlib.sha256(struct.pack("<8I", *tokens[:8])).digest()
    assert keys[0] == first.hex()
    assert keys[1] == hashlib.sha256(first + struct.pack("<8I", *tokens[8:16])).hexdigest()
    assert page_hashes(tokens[:16] + [7] * 8, 8)[:2] == keys  # a key depends on its past only
    salted = page_hashes(tokens, 8, ("salt", None))
    assert not set(salted) & set(keys)  # namespaces never share a key
    assert page_hashes(tokens, 8, ("salt", None)) == salted


def test_file_backend_batch_calls_lru_limit_and_restart(tmp_path):
    store = HiCacheFile(str(tmp_path), "m", max_bytes=3 * 100)
    keys = [f"k{i}" for i in range(4)]
    assert store.batch_set(keys[:3], [bytes([i]) * 100 for i in range(3)]) == [True] * 3
    assert store.batch_exists(keys) == 3
    assert store.get("k0") == bytes([0]) * 100  # refreshes k0: k1 is now the oldest
    assert store.set("k3", b"x" * 100)
    assert not store.exists("k1") and store.exists("k0") and store.exists("k3")
    assert store.batch_exists(["k0", "k1", "k2"]) == 1  # leading hits only
    assert sorted(os.listdir(tmp_path)) == sorted(f"{k}_m_0_1.bin" for k in ("k0", "k2", "k3"))
    again = HiCacheFile(str(tmp_path), "m", max_bytes=300)  # a restart finds the pages
    assert again.batch_get(["k2", "k1"]) == [bytes([2]) * 100, None]
    assert again.stored_bytes == 300
    assert HiCacheFile(str(tmp_path), "other", max_bytes=300).get("k2") is None  # another layout
    again.clear()
    assert os.listdir(tmp_path) == []


def test_file_backend_refuses_an_unwritable_directory(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError, match="hicache_storage_dir .* is not a writable directory"):
        HiCacheFile(str(blocker / "pages"), "m", max_bytes=1 << 20)


class GatedFile(HiCacheFile):
    """The file backend, with reads held until `gate` opens (a slow store)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.gate = threading.Event()

    def get(self, key):
        self.gate.wait(10)
        return super().get(key)


def rig(tmp_path, policy, storage_cls=HiCacheFile, **config):
    tree, pool = make(device=64, host=128)
    storage = storage_cls(str(tmp_path), "m", max_bytes=1 << 24)
    cfg = HiCacheConfig(prefetch_threshold=S, **config)
    return tree, pool, HiCacheController(tree, tree.io, storage, S, policy, cfg)


def stored_doc(tmp_path):
    """A 40-token document written to L3 by a first tree (write_through → on_backup)."""
    doc = list(range(500, 540))
    tree, pool, ctl = rig(tmp_path, "wait_complete")
    put(tree, pool, doc)
    ctl.drain_writes()
    assert len(os.listdir(tmp_path)) == 40 // S
    assert ctl.stats["l3_write_bytes"] == 40 * tree.io.host_pool.bytes_per_token
    ctl.close()
    return doc


def wait_ready(ctl, rid):
    deadline = time.monotonic() + 10
    while not ctl.ready(rid):
        assert time.monotonic() < deadline, "the prefetch never ended"
        time.sleep(0.01)


def held_accounting(tree, ctl):
    h = tree.host_allocator
    assert h.available_size() + tree.host_total_size() + ctl.host_held() == h.size


def test_prefetch_wait_complete_waits_then_loads_the_same_bytes(tmp_path):
    doc = stored_doc(tmp_path)
    tree, pool, ctl = rig(tmp_path, "wait_complete", GatedFile)
    ctl.prefetch("r", doc, None)
    assert ctl.prefetching() and ctl.host_held() == 40
    held_accounting(tree, ctl)
    assert not ctl.ready("r")
    ctl.storage.gate.set()
    wait_ready(ctl, "r")
    audit(tree)
    held_accounting(tree, ctl)
    m = tree.match_prefix(doc)
    assert len(m.indices) == 0 and m.host_len == 40
    loaded = tree.load_back(m, tree.allocator.alloc)
    assert_kv(pool, loaded.indices, doc)
    assert ctl.take_from_storage("r") == 40
    assert ctl.stats["l3_read_bytes"] == 40 * tree.io.host_pool.bytes_per_token
    ctl.close()


def test_prefetch_best_effort_stops_when_scheduled(tmp_path):
    doc = stored_doc(tmp_path)
    tree, pool, ctl = rig(tmp_path, "best_effort", GatedFile)
    ctl.prefetch("r", doc, None)
    threading.Timer(0.2, ctl.storage.gate.set).start()  # the batch in flight finishes, no more
    assert ctl.ready("r")
    assert not ctl.prefetching()
    held_accounting(tree, ctl)
    audit(tree)
    got = tree.match_prefix(doc).host_len  # what arrived: the batch in flight, whole pages
    assert got % S == 0 and got <= 40
    ctl.close()


def test_prefetch_timeout_gives_up_after_its_deadline(tmp_path):
    doc = stored_doc(tmp_path)
    tree, pool, ctl = rig(tmp_path, "timeout", GatedFile, prefetch_timeout_base=0.2,
                          prefetch_timeout_per_ki_token=0.0)
    ctl.prefetch("r", doc, None)
    assert not ctl.ready("r")
    time.sleep(0.3)
    ctl.storage.gate.set()
    assert ctl.ready("r")
    held_accounting(tree, ctl)
    ctl.close()


def test_prefetch_skips_what_the_tree_has_and_other_namespaces(tmp_path):
    doc = stored_doc(tmp_path)
    tree, pool, ctl = rig(tmp_path, "wait_complete")
    ctl.prefetch("salted", doc, ("salt", None))  # stored without a namespace: no key matches
    assert not ctl.prefetching()
    put(tree, pool, doc[:32])
    ctl.prefetch("tail", doc, None)  # only the last page is missing: only it is read
    assert ctl.host_held() == 8
    wait_ready(ctl, "tail")
    assert tree.match_prefix(doc).host_len == 8
    audit(tree)
    held_accounting(tree, ctl)
    ctl.close()


def test_forget_returns_the_host_slots(tmp_path):
    doc = stored_doc(tmp_path)
    tree, pool, ctl = rig(tmp_path, "wait_complete", GatedFile)
    ctl.prefetch("r", doc, None)
    threading.Timer(0.1, ctl.storage.gate.set).start()
    ctl.forget("r")  # the request was aborted while its pages were being read
    assert not ctl.prefetching() and ctl.host_held() == 0
    held_accounting(tree, ctl)
    audit(tree)
    ctl.close()
