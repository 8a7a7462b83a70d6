"""Waiting-queue order: the real DFS-weight walk over the radix tree."""

from lmprog_runtime.scheduler.policy import SchedulePolicy
from test_kv_manager import compute, make_kv, make_req

A = list(range(100, 132))          # a cached 32-token prefix
A1 = A + list(range(200, 216))     # two cached children under it
A2 = A + list(range(300, 316))
B = list(range(400, 432))          # another cached branch


def cache(kv, ids):
    r = make_req(ids, rid=f"warm{ids[-1]}")
    assert kv.assign(r)
    compute(kv, r, r.extend_len)
    kv.release(r)


def order(kv, policy, reqs):
    return [r.rid for r in SchedulePolicy(policy, kv.cache_enabled).order(reqs, kv.match_len, kv.match_node)]


def test_dfs_weight_visits_the_heaviest_subtree_first_and_keeps_it_together():
    kv = make_kv(1, pool_tokens=512)
    for ids in (A1, A2, B):
        cache(kv, ids)
    tail = [7, 8, 9]
    reqs = [make_req(B + tail, "b1"),          # arrives first, but B's subtree holds 2
            make_req(A2 + tail, "a2_1"),
            make_req(A1 + tail, "a1_1"),
            make_req(B + [5, 6], "b2"),
            make_req(A1 + [4], "a1_2"),
            make_req(A + [9, 9], "a_1"),       # ends at A itself
            make_req([1, 2, 3], "fresh")]      # nothing cached: hangs at the root
    # A's subtree has 4 requests (a_1 at A, a1 x2, a2 x1) > B's 2; inside A, A1 (2) before
    # A2 (1); a node's own requests after its descendants' (the root's `fresh` last)
    assert order(kv, "dfs-weight", reqs) == ["a1_1", "a1_2", "a2_1", "a_1", "b1", "b2", "fresh"]
    # lpm: longest match first, arrival order among equals; fcfs: arrival order
    assert order(kv, "lpm", reqs)[:3] == ["a2_1", "a1_1", "a1_2"]
    assert order(kv, "fcfs", reqs) == [r.rid for r in reqs]
    kv.check_integrity([])


def test_dfs_weight_without_cache_hits_is_arrival_order():
    kv = make_kv(16, pool_tokens=512)
    reqs = [make_req([i, i + 1, i + 2] * 10, f"r{i}") for i in range(5)]
    assert order(kv, "dfs-weight", reqs) == [r.rid for r in reqs]


def test_dfs_weight_ties_go_to_the_earlier_arrival():
    kv = make_kv(1, pool_tokens=512)
    for ids in (A1, B):
        cache(kv, ids)
    reqs = [make_req(B + [1], "b"), make_req(A1 + [1], "a")]
    assert order(kv, "dfs-weight", reqs) == ["b", "a"]
