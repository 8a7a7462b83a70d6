"""The Inspector's picture of the radix tree (cache/tree_view.py): the eviction order it
predicts is the order eviction then takes, the bound keeps a connected tree, and taking
the picture changes nothing."""

from inspect_helpers import decode, put, random_tree

from lmprog_runtime.cache.allocator import TokenSlotAllocator
from lmprog_runtime.cache.radix import RadixCache
from lmprog_runtime.cache.tree_view import eviction_order, tree_view


def fingerprint(tree):
    return sorted((n.id, n.key, n.last_access_time, n.lock_ref, n.parent.id) for n in tree.nodes())


def test_eviction_order_is_the_order_eviction_takes():
    alloc, tree, seqs = random_tree(120, seed=1)
    locked = tree.match_prefix(seqs[5]).last_node
    tree.inc_lock_ref(locked)  # a locked path is never predicted
    predicted = eviction_order(tree, list(tree.nodes()), 10_000)
    actual = []
    while True:
        before = {n.id for n in tree.nodes()}
        if not tree.evict(1):
            break
        gone = before - {n.id for n in tree.nodes()}
        assert len(gone) == 1
        actual.extend(gone)
    assert predicted == actual
    assert all(n.lock_ref > 0 for n in tree.nodes())  # what is left is the locked path
    tree.dec_lock_ref(locked)
    tree.check_integrity()


def test_view_is_read_only_and_complete():
    alloc, tree, seqs = random_tree(200, seed=2)
    tree.inc_lock_ref(tree.match_prefix(seqs[0]).last_node)
    before, clock = fingerprint(tree), tree.clock
    view = tree_view(tree, decode, max_nodes=10_000, evict_k=8)
    assert fingerprint(tree) == before and tree.clock == clock
    tree.check_integrity()
    nodes = {n["id"]: n for n in view["nodes"]}
    assert view["num_nodes"] == len(nodes) == len(before) and view["truncated"] == 0
    assert view["total_tokens"] == sum(n["tokens"] for n in nodes.values()) == tree.total_size()
    assert view["locked_tokens"] == sum(n["tokens"] for n in nodes.values() if n["lock_ref"] > 0)
    for n in nodes.values():
        kids = [c for c in nodes.values() if c["parent"] == n["id"]]
        assert n["children"] == len(kids) and n["hidden_children"] == 0
        assert n["subtree_tokens"] == n["tokens"] + sum(c["subtree_tokens"] for c in kids)
        parent = nodes.get(n["parent"])
        assert n["depth"] == (parent["depth"] + 1 if parent else 1)
    ranks = [nodes[i]["evict_rank"] for i in view["eviction_next"]]
    assert ranks == list(range(len(ranks))) and len(ranks) == 8


def test_bound_keeps_the_largest_subtrees_connected():
    alloc, tree, _ = random_tree(400, seed=3)
    full = tree_view(tree, decode, max_nodes=100_000)
    view = tree_view(tree, decode, max_nodes=50)
    assert view["shown"] == 50 and view["truncated"] == full["num_nodes"] - 50
    ids = {n["id"] for n in view["nodes"]}
    assert all(n["parent"] in ids or n["parent"] == view["root"] for n in view["nodes"])
    hidden = sum(n["hidden_children"] for n in view["nodes"])
    dropped = [n for n in full["nodes"] if n["id"] not in ids]
    smallest_kept = min(n["subtree_tokens"] for n in view["nodes"])
    assert all(n["subtree_tokens"] <= smallest_kept for n in dropped)
    # a dropped node whose parent was kept is counted on that parent as hidden
    assert sum(1 for n in dropped if n["parent"] in ids) == hidden


def test_namespaces_hits_and_labels():
    alloc = TokenSlotAllocator(1024)
    tree = RadixCache(alloc)
    put(alloc, tree, list(range(30)), namespace=("salt-a", None))
    put(alloc, tree, list(range(5)))
    node = tree.match_prefix(list(range(30)), ("salt-a", None)).last_node
    tree.record_hit(node)
    tree.record_hit(node)
    view = tree_view(tree, decode, max_nodes=100)
    by_ns = {(n["namespace"] or {}).get("cache_salt"): n for n in view["nodes"]}
    assert set(by_ns) == {"salt-a", None}
    salted = by_ns["salt-a"]
    assert salted["hits"] == 2 and salted["tokens"] == 30
    assert salted["text"] == decode(range(12)) + "…"  # the first EDGE_TOKENS tokens, then an ellipsis
    assert by_ns[None]["hits"] == 0 and by_ns[None]["text"] == decode(range(5))


def test_hicache_tiers_and_device_eviction_order():
    import random as _random

    from hicache_helpers import make as make_hi, put as put_hi

    tree, pool = make_hi(device=256, host=1024)
    rng = _random.Random(4)
    docs = [[rng.randrange(20) for _ in range(rng.randint(3, 12))] for _ in range(30)]
    for d in docs:
        put_hi(tree, pool, d)
    tree.evict(60)  # some nodes now live on the host tier only
    view = tree_view(tree, decode, max_nodes=10_000, evict_k=10_000)
    tiers = {n["tier"] for n in view["nodes"]}
    assert tiers == {"device", "host"} and view["host_tokens"] == tree.host_total_size()
    assert all(n["backed_up"] for n in view["nodes"] if n["tier"] == "host")
    predicted = view["eviction_next"]
    actual = []
    while True:
        before = {n.id for n in tree.nodes() if n.value is not None}
        if not tree.evict(1):
            break
        actual.extend(before - {n.id for n in tree.nodes() if n.value is not None})
    assert predicted == actual


def test_label_cache_decodes_only_new_or_split_nodes():
    alloc = TokenSlotAllocator(1024)
    tree = RadixCache(alloc)
    put(alloc, tree, list(range(20)))
    calls = []

    def counting(ids):
        calls.append(tuple(ids))
        return decode(ids)

    cache = {}
    first = tree_view(tree, counting, max_nodes=100, label_cache=cache)
    assert len(calls) == 1
    again = tree_view(tree, counting, max_nodes=100, label_cache=cache)
    assert len(calls) == 1 and again["nodes"] == first["nodes"]
    put(alloc, tree, list(range(5)) + [99, 98])  # splits the node after 5 tokens
    view = tree_view(tree, counting, max_nodes=100, label_cache=cache)
    texts = sorted(n["text"] for n in view["nodes"])
    assert texts == sorted([decode(range(5)), decode(range(5, 17)) + "…", decode([99, 98])])
    assert len(calls) == 4 and len(cache) == 3  # the prefix, the shortened suffix, the new leaf


def test_storage_only_nodes_show_the_storage_tier():
    from hicache_helpers import DictStorage, make as make_hi, put as put_hi

    tree, pool = make_hi(device=64, host=128)
    DictStorage(tree, page_tokens=8)
    doc = list(range(200, 244))
    put_hi(tree, pool, doc)
    assert tree.evict(44) == 44 and tree.evict_host(44) == 44  # now in L3 only (whole pages)
    view = tree_view(tree, decode, max_nodes=100)
    stored = [n for n in view["nodes"] if n["tier"] == "storage"]
    assert sum(n["tokens"] for n in stored) == tree.storage_total_size() == 40
    assert not any(n["backed_up"] for n in stored)
