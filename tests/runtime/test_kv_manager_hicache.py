"""KVManager with HiCache (no model): assign loads a host-resident prefix back (or leaves
it to recompute when the cost model says so), retraction and release go through the tiered
tree, and both tiers' audit holds after every move."""

import pytest

from lmprog_runtime.cache.hicache import HiCacheConfig, HiCacheController
from lmprog_runtime.cache.kv_pool import ReqToTokenPool
from lmprog_runtime.cache.manager import KVManager
from hicache_helpers import make
from test_kv_manager import compute, make_req


def make_hikv(p=1, device=128, host=512):
    tree, pool = make(device=device, host=host, page_size=p)
    ctl = HiCacheController(tree, tree.io, None, 64, "timeout", HiCacheConfig())
    return KVManager(ReqToTokenPool(4, 512), tree.allocator, tree, ctl), pool


def run_to_end(kv, req):
    assert kv.assign(req)
    compute(kv, req, req.extend_len)
    kv.check_integrity([req])
    kv.release(req)
    kv.check_integrity([])


@pytest.mark.parametrize("p", [1, 4])
def test_assign_loads_the_host_part_back(p):
    kv, _ = make_hikv(p)
    doc = list(range(1000, 1080))
    run_to_end(kv, make_req(doc, rid="first"))
    for i in range(3):  # three other documents push the first one out of L1
        run_to_end(kv, make_req(list(range(i * 100, i * 100 + 80)), rid=f"other{i}"))
    again = make_req(doc, rid="again")
    assert kv.match_len(again) == 79 // p * p  # device + host
    assert kv.assign(again)
    assert again.kv_len == 79 // p * p and again.tier_hits[1] > 0
    assert kv.hicache.stats["hicache_decisions_load"] == 1
    kv.check_integrity([again])
    compute(kv, again, again.extend_len)
    kv.release(again)
    kv.check_integrity([])


def test_recompute_when_the_cost_model_says_so():
    kv, _ = make_hikv()
    doc = list(range(1000, 1080))
    run_to_end(kv, make_req(doc, rid="first"))
    kv.tree.evict(1000)
    kv.tree.io.load_bytes_per_s = 1e9
    kv.hicache.stats["hicache_prefill_tokens_per_s"] = 1e12  # recomputing is "free"
    again = make_req(doc, rid="again")
    assert kv.assign(again) and again.kv_len == 0
    assert kv.hicache.stats["hicache_decisions_recompute"] == 1
    compute(kv, again, again.extend_len)
    kv.release(again)  # its slots revive the evicted nodes
    kv.check_integrity([])
    assert len(kv.tree.match_prefix(doc).indices) == 80


def test_retract_and_unassign_keep_both_tiers_exact():
    kv, _ = make_hikv(device=128)
    a, b = make_req(list(range(0, 60)), rid="a"), make_req(list(range(500, 560)), rid="b")
    run_to_end(kv, make_req(list(range(0, 60)), rid="warm"))
    kv.tree.evict(1000)
    assert kv.assign(a) and a.kv_len == 59
    assert kv.assign(b)
    compute(kv, b, b.extend_len)
    kv.check_integrity([a, b])
    kv.retract(b)
    kv.unassign(a)
    kv.check_integrity([])
    kv.flush()
    kv.check_integrity([])
    assert kv.allocator.available_size() == 128 and kv.tree.host_allocator.available_size() == 512
