"""Unit tests of the RadixAttention tree: match/insert/split, namespaces, locks, LRU eviction."""

import time

import pytest
import torch

from lmprog_runtime.cache.allocator import TokenSlotAllocator
from lmprog_runtime.cache.radix import RadixCache


def make(size=256, page_size=1, **kw):
    alloc = TokenSlotAllocator(size, page_size)
    return alloc, RadixCache(alloc, page_size=page_size, **kw)


def put(alloc, tree, tokens, namespace=None):
    """Insert like the scheduler does: allocate, insert, free the duplicates and the tail."""
    p = alloc.page_size
    kv = alloc.alloc(-(-len(tokens) // p) * p)
    already = tree.insert(tokens, kv[:len(tokens)], namespace)
    aligned = len(tokens) - len(tokens) % p
    alloc.free(kv[:already])
    alloc.free(kv[aligned:])
    tree.check_integrity()
    assert alloc.available_size() + tree.total_size() == alloc.size
    return already, kv


def path_key(node):
    key = ()
    while node.parent is not None:
        key = node.key + key
        node = node.parent
    return key


def test_insert_match_exact_prefix_longer():
    alloc, tree = make()
    _, kv = put(alloc, tree, [1, 2, 3, 4, 5])
    m = tree.match_prefix([1, 2, 3, 4, 5])
    assert m.indices.tolist() == kv.tolist() and path_key(m.last_node) == (1, 2, 3, 4, 5)
    m = tree.match_prefix([1, 2, 3, 4, 5, 6, 7])
    assert m.indices.tolist() == kv.tolist()
    assert tree.match_prefix([9, 1, 2]).indices.numel() == 0
    assert tree.match_prefix([9]).last_node is tree.root
    assert tree.match_prefix([]).last_node is tree.root
    m.indices[0] = -1  # a fresh tensor: the tree's copy is untouched
    assert tree.match_prefix([1]).indices.tolist() == kv[:1].tolist()
    tree.check_integrity()


def test_partial_match_splits_and_keeps_suffix_object():
    alloc, tree = make()
    _, kv = put(alloc, tree, [1, 2, 3, 4, 5])
    leaf = tree.match_prefix([1, 2, 3, 4, 5]).last_node
    m = tree.match_prefix([1, 2, 9])
    assert m.indices.tolist() == kv[:2].tolist()
    assert m.last_node.key == (1, 2) and list(m.last_node.children.values()) == [leaf]
    assert leaf.key == (3, 4, 5) and leaf.parent is m.last_node
    assert leaf.value.tolist() == kv[2:].tolist()
    tree.check_integrity()


def test_insert_shared_prefix_returns_already_cached():
    alloc, tree = make()
    _, kv1 = put(alloc, tree, [1, 2, 3, 4, 5])
    already, kv2 = put(alloc, tree, [1, 2, 3, 9, 9])
    assert already == 3 and tree.total_size() == 7
    assert tree.match_prefix([1, 2, 3, 9, 9]).indices.tolist() == kv1[:3].tolist() + kv2[3:].tolist()
    (top,) = tree.root.children.values()
    assert top.key == (1, 2, 3) and sorted(c.key for c in top.children.values()) == [(4, 5), (9, 9)]
    assert put(alloc, tree, [1, 2, 3, 9, 9])[0] == 5
    assert put(alloc, tree, [1, 2])[0] == 2 and top.key == (3,)  # split; top keeps the suffix
    assert tree.total_size() == 7


def test_namespaces_never_share():
    alloc, tree = make()
    put(alloc, tree, [1, 2, 3])
    for ns in ["salt", ("salt", 7), (None, "lora")]:
        assert tree.match_prefix([1, 2, 3], namespace=ns).indices.numel() == 0
        assert put(alloc, tree, [1, 2, 3, 4], namespace=ns)[0] == 0
        assert tree.match_prefix([1, 2, 3, 4], namespace=ns).indices.numel() == 4
    assert tree.match_prefix([1, 2, 3, 4]).indices.numel() == 3
    assert len(tree.root.children) == 4 and tree.total_size() == 3 + 3 * 4


def test_lock_protects_and_evict_is_lru():
    alloc, tree = make()
    for first in (10, 20, 30):
        put(alloc, tree, [first, 1, 2, 3])
    tree.match_prefix([10, 1, 2, 3])  # touch: 10-branch is now the most recent
    assert tree.evictable_size() == 12 and tree.protected_size() == 0
    assert tree.evict(1) == 4  # a whole leaf: the 20-branch, least recently used
    assert tree.match_prefix([20, 1]).indices.numel() == 0
    assert tree.match_prefix([30, 1, 2, 3]).indices.numel() == 4  # now 10 is the oldest
    locked = tree.match_prefix([10, 1, 2, 3]).last_node
    tree.inc_lock_ref(locked)
    assert (tree.evictable_size(), tree.protected_size()) == (4, 4)
    assert tree.evict(100) == 4  # only the 30-branch can go
    assert tree.match_prefix([10, 1, 2, 3]).indices.numel() == 4
    tree.check_integrity()
    tree.dec_lock_ref(locked)
    assert (tree.evictable_size(), tree.protected_size()) == (4, 0)
    assert tree.evict(1) == 4 and tree.total_size() == 0
    assert alloc.available_size() == alloc.size
    tree.check_integrity()


def test_lock_on_split_node_and_parents_evicted_after_children():
    alloc, tree = make()
    put(alloc, tree, [1, 2, 3, 4])
    put(alloc, tree, [1, 2, 7, 8])
    inner = tree.match_prefix([1, 2]).last_node
    tree.inc_lock_ref(inner)
    tree.match_prefix([1, 2, 3, 9])
    tree.inc_lock_ref(inner)  # twice: 0->1 happened once
    assert tree.protected_size() == 2 and inner.lock_ref == 2
    assert tree.evict(100) == 4 and tree.total_size() == 2
    tree.dec_lock_ref(inner)
    assert tree.protected_size() == 2
    tree.dec_lock_ref(inner)
    assert tree.evict(1) == 2 and tree.total_size() == 0  # the parent became a leaf
    with pytest.raises(AssertionError, match="not in this tree"):
        tree.inc_lock_ref(inner)  # evicted node
    tree.check_integrity()


def test_partial_touch_leaves_the_suffix_old():
    alloc, tree = make()
    put(alloc, tree, [10, 1, 2, 3])
    put(alloc, tree, [20, 1, 2, 3])
    tree.match_prefix([10, 1])  # splits [10 1 | 2 3]; only [10 1] is touched
    assert tree.evict(1) == 2  # [2 3], untouched since its insert, goes first
    assert tree.match_prefix([10, 1, 2, 3]).indices.numel() == 2
    assert tree.match_prefix([20, 1, 2, 3]).indices.numel() == 4


def test_dec_lock_below_zero_asserts():
    alloc, tree = make()
    put(alloc, tree, [1, 2])
    node = tree.match_prefix([1, 2]).last_node
    with pytest.raises(AssertionError):
        tree.dec_lock_ref(node)
    tree.inc_lock_ref(tree.root)  # the root is always locked: no-op
    tree.dec_lock_ref(tree.root)
    assert tree.root.lock_ref == 1


@pytest.mark.parametrize("page_size", [4, 16])
def test_pages(page_size):
    alloc, tree = make(size=16 * page_size, page_size=page_size)
    p = page_size
    tokens = list(range(100, 100 + 2 * p + 3))  # two pages and a partial one
    already, kv = put(alloc, tree, tokens)
    assert already == 0 and tree.total_size() == 2 * p
    assert tree.match_prefix(tokens).indices.tolist() == kv[:2 * p].tolist()
    assert tree.match_prefix(tokens[:2 * p - 1]).indices.numel() == p  # truncated to a page
    assert tree.match_prefix(tokens[:p - 1]).indices.numel() == 0
    # a mismatch inside page 2 splits after page 1
    other = tokens[:p] + tokens[p:p + 1] + [7] * (p - 1)
    m = tree.match_prefix(other)
    assert m.indices.tolist() == kv[:p].tolist() and len(m.last_node.key) == p
    tree.check_integrity()
    already, kv2 = put(alloc, tree, other)
    assert already == p and tree.total_size() == 3 * p
    assert tree.match_prefix(other).indices.tolist() == kv[:p].tolist() + kv2[p:2 * p].tolist()
    assert tree.evict(1) == p and tree.total_size() == 2 * p
    assert tree.evict(10 * p) == 2 * p and alloc.available_size() == alloc.size
    tree.check_integrity()


def test_page_size_must_match_allocator():
    with pytest.raises(ValueError, match="allocator"):
        RadixCache(TokenSlotAllocator(64, 4), page_size=1)


def test_insert_validates_kv_length():
    alloc, tree = make()
    with pytest.raises(ValueError, match="expected at least 3"):
        tree.insert([1, 2, 3], torch.tensor([5, 6]))


def test_reset_frees_everything():
    alloc, tree = make()
    put(alloc, tree, [1, 2, 3])
    put(alloc, tree, [1, 5, 6], namespace="x")
    node = tree.match_prefix([1, 2, 3]).last_node
    tree.inc_lock_ref(node)
    with pytest.raises(AssertionError):
        tree.reset()
    tree.dec_lock_ref(node)
    tree.reset()
    assert tree.total_size() == 0 and not tree.root.children
    assert alloc.available_size() == alloc.size
    assert tree.match_prefix([1, 2, 3]).indices.numel() == 0
    tree.check_integrity()


def test_disabled_cache_keeps_nothing():
    alloc, tree = make(disable=True)
    kv = alloc.alloc(4)
    assert tree.insert([1, 2, 3, 4], kv) == 4  # the caller keeps (and frees) all its slots
    m = tree.match_prefix([1, 2, 3, 4])
    assert m.indices.numel() == 0 and m.last_node is tree.root
    tree.inc_lock_ref(m.last_node)
    tree.dec_lock_ref(m.last_node)
    assert tree.evict(10) == 0 and tree.total_size() == 0
    tree.check_integrity()


def test_pretty_print_and_integrity_catch_drift(capsys):
    alloc, tree = make()
    put(alloc, tree, [1, 2, 3])
    put(alloc, tree, [1, 2, 4])
    text = tree.pretty_print()
    assert "len=2" in text and "len=1" in text and text in capsys.readouterr().out
    tree._evictable += 1
    with pytest.raises(AssertionError, match="sizes"):
        tree.check_integrity()


def test_long_prompt_is_fast():
    alloc, tree = make(size=8192)
    prompt = list(range(2000))
    put(alloc, tree, prompt)
    branch = prompt[:1500] + [-1] * 500
    put(alloc, tree, branch)
    kv = alloc.alloc(2000)
    calls = 200
    start = time.perf_counter()
    for i in range(calls):
        assert tree.match_prefix(prompt if i % 2 else branch).indices.numel() == 2000
        assert tree.insert(prompt, kv) == 2000
    per_call = (time.perf_counter() - start) / (2 * calls)
    assert per_call < 2e-3, f"{per_call * 1e6:.0f} us per match/insert of 2000 tokens"
