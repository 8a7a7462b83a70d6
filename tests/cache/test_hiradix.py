"""HiRadixCache unit tests over real pools: write policies, L1 eviction onto L2, load-back
bytes, host eviction in LRU order, revival by insert, host-only inserts, the smaller host
dtype, and a random walk of every operation with the two-tier audit after each step."""

import random

import pytest
import torch

from hicache_helpers import LAYERS, DictStorage, assert_kv, audit, full_match, kv_of, make, put


@pytest.mark.parametrize("layerwise", [False, True], ids=["direct", "layerwise"])
def test_write_through_evict_keeps_host_copy_and_loads_back_same_bytes(layerwise):
    tree, pool = make(layerwise=layerwise)
    doc = list(range(100, 140))
    put(tree, pool, doc)
    assert tree.host_total_size() == 40  # backed up at the first insert
    assert tree.evict(40) == 40
    audit(tree)
    m = tree.match_prefix(doc)
    assert len(m.indices) == 0 and m.host_len == 40
    loaded = tree.load_back(m, tree.allocator.alloc)
    assert len(loaded.indices) == 40 and loaded.host_len == 0
    assert_kv(pool, loaded.indices, doc)
    audit(tree)


def test_write_through_selective_backs_up_on_reuse_only():
    tree, pool = make(policy="write_through_selective")
    doc = list(range(1, 21))
    put(tree, pool, doc)
    assert tree.host_total_size() == 0
    put(tree, pool, doc + [5, 6])  # the document is re-used: now it is worth a host copy
    assert tree.host_total_size() == 20
    tree.evict(64)
    audit(tree)
    assert tree.match_prefix(doc).host_len == 20  # the re-used part survives, the tail was deleted
    assert tree.match_prefix(doc + [5, 6]).host_len == 20


def test_write_back_copies_at_eviction_with_ancestors():
    tree, pool = make(policy="write_back")
    a, b = list(range(1, 17)), list(range(1, 9)) + list(range(50, 58))
    put(tree, pool, a)
    put(tree, pool, b)
    assert tree.host_total_size() == 0
    tree.evict(8)  # one leaf: its shared parent is backed up first, and stays resident
    audit(tree)
    assert tree.host_total_size() >= 16
    tree.evict(64)
    for seq in (a, b):
        m = full_match(tree, seq)
        assert len(m.indices) == 16
        assert_kv(pool, m.indices, seq)
    audit(tree)


def test_host_eviction_is_lru_and_never_touches_resident_nodes():
    tree, pool = make(device=32, host=48)
    docs = [list(range(d * 100, d * 100 + 16)) for d in range(5)]
    for d in docs:
        put(tree, pool, d)  # device eviction drops device copies, host eviction deletes the oldest
    audit(tree)
    assert tree.match_prefix(docs[0]).host_len == 0 and len(tree.match_prefix(docs[0]).indices) == 0
    last = tree.match_prefix(docs[-1])
    assert len(last.indices) == 16  # resident (and backed up)
    assert tree.host_total_size() <= 48


def test_insert_revives_evicted_nodes_with_the_callers_slots():
    tree, pool = make()
    doc = list(range(10, 30))
    put(tree, pool, doc)
    tree.evict(20)
    assert tree.evictable_size() == 0
    slots = tree.allocator.alloc(20)
    for layer in range(LAYERS):
        kv = kv_of(doc, layer)
        pool.set_kv(layer, slots, kv, -kv)
    assert tree.insert(doc, slots) == 0  # nothing resident: the tree took all 20 slots
    audit(tree)
    m = tree.match_prefix(doc)
    assert torch.equal(m.indices, slots) and m.host_len == 0


def test_insert_host_attaches_below_the_cached_prefix():
    tree, pool = make()
    doc = list(range(1, 41))
    put(tree, pool, doc[:16])
    host = tree.alloc_host(24)
    tree.io.write_page(host, tree.io.page_bytes(host))  # any bytes: only the bookkeeping matters here
    assert tree.insert_host(doc, 16, host) == 0
    audit(tree)
    m = tree.match_prefix(doc)
    assert len(m.indices) == 16 and m.host_len == 24
    again = tree.alloc_host(24)
    assert tree.insert_host(doc, 16, again) == 24  # already there: the caller frees all
    tree.host_allocator.free(again)
    gone = tree.alloc_host(8)
    assert tree.insert_host(list(range(900, 940)), 32, gone) == 8  # the path to 32 does not exist
    tree.host_allocator.free(gone)
    audit(tree)


def test_bfloat16_host_pool_round_trips_through_the_conversion():
    tree, pool = make(host_dtype=torch.bfloat16)
    doc = list(range(3, 35))
    put(tree, pool, doc)
    tree.evict(32)
    m = full_match(tree, doc)
    assert_kv(pool, m.indices, doc, dtype=torch.bfloat16)  # rounded once to bf16, widened exactly
    exact = kv_of(doc, 0)
    assert not torch.equal(pool.k[0, m.indices], exact)  # the conversion really happened
    assert torch.allclose(pool.k[0, m.indices], exact, rtol=1e-2)


def test_page_bytes_round_trip():
    tree, pool = make(page_size=4)
    doc = list(range(7, 23))
    put(tree, pool, doc)
    node = tree.match_prefix(doc).last_node
    data = tree.io.page_bytes(node.host_value)
    assert len(data) == tree.io.page_nbytes(16)
    fresh = tree.alloc_host(16)
    tree.io.write_page(fresh, data)
    h = tree.io.host_pool
    assert torch.equal(h.k[:, fresh], h.k[:, node.host_value])
    assert torch.equal(h.v[:, fresh], h.v[:, node.host_value])
    tree.host_allocator.free(fresh)


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_random_operations_keep_both_tiers_exact(policy, page_size):
    rng = random.Random(f"{policy}-{page_size}")
    tree, pool = make(device=64, host=160, page_size=page_size, policy=policy)
    stems = [[rng.randrange(50) for _ in range(rng.randrange(4, 24))] for _ in range(6)]
    for step in range(300):
        op = rng.random()
        seq = rng.choice(stems) + [rng.randrange(50) for _ in range(rng.randrange(0, 12))]
        seq = seq[:len(seq) - len(seq) % page_size] or seq[:page_size]
        if op < 0.45:
            put(tree, pool, seq, namespace=rng.choice([None, "salt"]))
        elif op < 0.75:
            m = tree.match_prefix(seq)
            if m.host_len:
                loaded = tree.load_back(m, lambda n: _alloc_evicting(tree, n))
                if loaded is not None:
                    assert_kv(pool, loaded.indices, list(seq[:len(loaded.indices)]))
        elif op < 0.9:
            tree.evict(rng.randrange(1, 40))
        else:
            tree.evict_host(rng.randrange(1, 40))
        audit(tree)
    tree.reset()
    audit(tree)
    assert tree.allocator.available_size() == 64 and tree.host_allocator.available_size() == 160


def _alloc_evicting(tree, n):
    slots = tree.allocator.alloc(n)
    if slots is None:
        tree.evict(n - tree.allocator.available_size())
        slots = tree.allocator.alloc(n)
    return slots


def test_l1_to_l2_to_storage_only_and_back_gives_the_same_kv():
    """A document evicted from L1 and then from L2 stays in the tree as storage-only nodes
    (its tail past the last whole L3 page is deleted); the match reports that part, a
    prefetch fills the nodes from the pages and the load-back restores the exact KV."""
    tree, pool = make(device=64, host=128)
    store = DictStorage(tree, page_tokens=8)
    doc = list(range(200, 244))  # 44 tokens: 5 whole pages + a 4-token tail
    put(tree, pool, doc)
    assert len(store.pages) == 5
    assert tree.evict(44) == 44 and tree.evict_host(44) == 44
    audit(tree)
    assert tree.host_total_size() == 0 and tree.storage_total_size() == 40
    m = tree.match_prefix(doc)
    assert (len(m.indices), m.host_len, m.storage_len) == (0, 0, 40)
    assert m.last_host_node is tree.root
    assert store.prefetch(doc) == 40
    audit(tree)
    m = tree.match_prefix(doc)
    assert (m.host_len, m.storage_len) == (40, 0)
    m = tree.load_back(m, tree.allocator.alloc)
    assert_kv(pool, m.indices, doc[:40])
    audit(tree)


def test_storage_only_nodes_under_a_cached_prefix_and_revival_by_insert():
    tree, pool = make(device=64, host=128)
    store = DictStorage(tree, page_tokens=8)
    stem, a, b = list(range(1, 13)), list(range(50, 68)), list(range(80, 98))  # 12 + 18 tokens
    put(tree, pool, stem + a)
    put(tree, pool, stem + b)
    tree.evict(64)
    assert tree.evict_host(30) == 36  # both branches (LRU); the stem keeps its host copy
    audit(tree)
    for branch in (a, b):
        m = tree.match_prefix(stem + branch)
        assert (m.host_len, m.storage_len) == (12, 12)  # to the last whole page (24); the tails are gone
    assert store.prefetch(stem + a) == 12  # pages 1..2 read, page 1's first 4 tokens were cached
    assert_kv(pool, full_match(tree, stem + a).indices, (stem + a)[:24])
    slots = put(tree, pool, stem + b)  # computed again: the storage-only node takes device slots
    assert tree.storage_total_size() == 0 and len(slots) == 30
    assert_kv(pool, tree.match_prefix(stem + b).indices, stem + b)
    audit(tree)


def test_storage_only_nodes_are_lru_bounded_and_pruned_when_storage_lost_pages():
    from lmprog_runtime.cache.hiradix import L3Index

    tree, pool = make(device=32, host=48)
    store = DictStorage(tree, page_tokens=8)
    tree.l3 = L3Index(8, tree.l3.stored, max_tokens=32)
    docs = [list(range(d * 100, d * 100 + 16)) for d in range(6)]
    for d in docs:
        put(tree, pool, d)
    tree.evict(64)
    tree.evict_host(64)
    audit(tree)
    assert tree.storage_total_size() == 32  # the two most recent documents are remembered
    assert [tree.match_prefix(d).storage_len for d in docs] == [0, 0, 0, 0, 16, 16]
    assert tree.drop_storage_after(docs[5], None, 8) == 16  # storage holds only its first page
    assert tree.match_prefix(docs[5]).storage_len == 0
    audit(tree)


def test_without_storage_host_eviction_deletes():
    tree, pool = make()
    put(tree, pool, list(range(300, 340)))
    tree.evict(40)
    assert tree.evict_host(40) == 40
    assert tree.storage_total_size() == 0 and tree.total_size() == 0 and not tree.root.children
    audit(tree)


@pytest.mark.parametrize("page_size,layerwise", [(1, False), (4, False), (1, True)])
def test_random_operations_with_a_storage_tier(page_size, layerwise):
    rng = random.Random(f"l3-{page_size}")
    tree, pool = make(device=64, host=160, page_size=page_size, layerwise=layerwise)
    store = DictStorage(tree, page_tokens=8)
    stems = [[rng.randrange(50) for _ in range(rng.randrange(4, 28))] for _ in range(6)]
    seen = set()
    for step in range(300):
        op = rng.random()
        seq = rng.choice(stems) + [rng.randrange(50) for _ in range(rng.randrange(0, 12))]
        seq = seq[:len(seq) - len(seq) % page_size] or seq[:page_size]
        ns = rng.choice([None, "salt"])
        if op < 0.35:
            put(tree, pool, seq, namespace=ns)
        elif op < 0.55:
            store.prefetch(seq, ns)
        elif op < 0.7:
            m = tree.match_prefix(seq, ns)
            if m.host_len:
                loaded = tree.load_back(m, lambda n: _alloc_evicting(tree, n))
                if loaded is not None:
                    assert_kv(pool, loaded.indices, list(seq[:len(loaded.indices)]))
        elif op < 0.85:
            tree.evict(rng.randrange(1, 40))
        else:
            tree.evict_host(rng.randrange(1, 60))
        audit(tree)
        seen.add(tree.storage_total_size() > 0)
    assert seen == {True, False}  # storage-only nodes came and went
    tree.reset()
    audit(tree)


def test_detaching_storage_forgets_storage_only_nodes():
    tree, pool = make()
    DictStorage(tree, page_tokens=8)
    stem, doc = list(range(1, 9)), list(range(20, 44))
    put(tree, pool, stem + doc)
    put(tree, pool, stem + [7] * 8)
    tree.evict(64)
    tree.evict_host(64)
    assert tree.storage_total_size() == 40
    tree.l3 = None
    tree.drop_storage_only()
    assert tree.storage_total_size() == 0 and tree.total_size() == 0 and not tree.root.children
    audit(tree)


def test_layer_loads_wait_per_layer_and_in_order():
    """The forward of layer i waits only for layer i: a load blocked in layer 1 lets
    `wait(0)` return and holds `wait(1)` until it moves on; `drain` waits for all."""
    import threading

    from lmprog_runtime.cache.layer_loads import LayerLoads

    loads, gate, copied = LayerLoads(3), threading.Event(), []

    def copy_layer(layer):
        if layer == 1:
            assert gate.wait(30)
        copied.append(layer)

    loads.submit(copy_layer)
    loads.wait(0)
    assert copied == [0] and loads.pending
    waiter = threading.Thread(target=loads.wait, args=(1,))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()  # layer 1 is not copied yet
    gate.set()
    waiter.join(30)
    loads.drain()
    assert copied == [0, 1, 2] and not loads.pending

    def broken(layer):
        raise OSError("copy failed")

    loads.submit(broken)
    with pytest.raises(RuntimeError, match="load-back failed"):
        loads.wait(0)
    with pytest.raises(RuntimeError, match="load-back failed"):  # sticky: those slots are garbage
        loads.drain()
    loads.close()
