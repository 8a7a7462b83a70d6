"""KVManager on its own (no model): every ownership move keeps
free + tree + requests == pool, with page_size 1 and 16."""

import pytest

from lmprog_runtime.cache.allocator import TokenSlotAllocator
from lmprog_runtime.cache.kv_pool import ReqToTokenPool
from lmprog_runtime.cache.manager import KVManager
from lmprog_runtime.cache.radix import KVIntegrityError, RadixCache
from lmprog_runtime.messages import TokenizedGenerateReq
from lmprog_runtime.sampling_params import SamplingParams
from lmprog_runtime.scheduler.request import Req


def make_kv(page_size, pool_tokens=256, rows=4, cache=True):
    alloc = TokenSlotAllocator(pool_tokens, page_size)
    tree = RadixCache(alloc, page_size=page_size, disable=not cache)
    return KVManager(ReqToTokenPool(rows, 512), alloc, tree)


def make_req(ids, rid="r", max_new_tokens=8):
    msg = TokenizedGenerateReq(rid=rid, input_ids=list(ids),
                               sampling_params=SamplingParams(max_new_tokens=max_new_tokens))
    return Req(msg)


def compute(kv, req, n):
    """What a step does for `req`: slots for n positions, then commit them."""
    loc = kv.alloc_extend(req, n)
    assert loc is not None and loc.numel() == n
    kv.commit(req, n)
    return loc


def pages_of(loc, p):
    return set((loc // p).tolist())


@pytest.mark.parametrize("p", [1, 16])
def test_assign_commit_release_caches_the_aligned_prefix(p):
    kv = make_kv(p)
    prompt = list(range(100, 140))  # 40 tokens
    a = make_req(prompt)
    assert kv.assign(a) and a.kv_len == 0 and a.row is not None
    loc = compute(kv, a, len(prompt))
    assert a.kv_len == 40
    # positions of one page share a page; slots are distinct
    assert len(set(loc.tolist())) == 40 and len(pages_of(loc, p)) == -(-40 // p)
    assert kv.held_by([a]) == -(-40 // p) * p
    kv.check_integrity([a])
    kv.release(a)
    assert a.row is None and a.last_node is None
    kv.check_integrity([])
    aligned = 40 // p * p
    assert kv.tree.total_size() == aligned
    # the same prompt again: the tree serves the aligned prefix (one token always computed)
    b = make_req(prompt, rid="b")
    assert kv.match_len(b) == min(aligned, 39 // p * p)
    assert kv.assign(b) and b.kv_len == b.cache_protected_len == min(aligned, 39 // p * p)
    compute(kv, b, b.extend_len)
    kv.check_integrity([b])
    kv.release(b)
    kv.check_integrity([])


@pytest.mark.parametrize("p", [1, 16])
def test_cache_unfinished_shares_a_running_prompt(p):
    kv = make_kv(p)
    a = make_req(list(range(50)))
    kv.assign(a)
    compute(kv, a, 50)
    kv.cache_unfinished(a)
    assert a.cache_protected_len == 50 // p * p
    assert kv.tree.protected_size() == 50 // p * p  # locked while `a` runs
    kv.check_integrity([a])
    b = make_req(list(range(50)) + [7, 8], rid="b")
    assert kv.match_len(b) == 50 // p * p
    kv.release(a)
    kv.check_integrity([])


@pytest.mark.parametrize("p", [1, 16])
def test_truncate_frees_whole_pages_past_the_new_end(p):
    kv = make_kv(p)
    a = make_req(list(range(20)))
    kv.assign(a)
    compute(kv, a, 20)
    for _ in range(20):  # twenty decode steps
        a.output_ids.append(5)
        compute(kv, a, 1)
    assert a.kv_len == 40
    free_before = kv.allocator.available_size()
    kv.truncate(a, 27)  # a jump-forward rewrote output tokens from position 27
    assert a.kv_len == 27
    # the page holding position 26 stays (27 is mid-page unless p == 1)
    assert kv.allocator.available_size() - free_before == (-(-40 // p) - -(-27 // p)) * p
    kv.check_integrity([a])
    a.output_ids[7:] = [9, 9, 9]  # the rewritten tail: 20 + 10 tokens
    loc = compute(kv, a, a.extend_len)
    row = kv.req_pool.table[a.row]
    if p > 1:  # position 27 reuses position 26's page
        assert int(loc[0]) // p == int(row[26]) // p
    assert len(set(row[:a.kv_len].tolist())) == a.kv_len
    kv.check_integrity([a])
    kv.truncate(a, 0)  # never below the tree-owned prefix
    assert a.kv_len == a.cache_protected_len
    kv.release(a)
    kv.check_integrity([])


@pytest.mark.parametrize("p", [1, 16])
def test_retract_gives_back_everything_and_keeps_tokens(p):
    kv = make_kv(p)
    a = make_req(list(range(33)))
    kv.assign(a)
    compute(kv, a, 33)
    a.output_ids += [1, 2, 3]
    compute(kv, a, 3)
    kv.retract(a)
    assert (a.row, a.kv_len, a.cache_protected_len, a.last_node) == (None, 0, 0, None)
    assert a.output_ids == [1, 2, 3]
    kv.check_integrity([])
    assert kv.tree.total_size() == 36 // p * p  # computed pages went to the tree
    # re-admission finds them again
    assert kv.assign(a) and a.kv_len == min(36 // p * p, 35 // p * p)
    kv.unassign(a)
    kv.check_integrity([])


@pytest.mark.parametrize("p", [1, 16])
def test_full_pool_evicts_the_tree_then_refuses(p):
    kv = make_kv(p, pool_tokens=64)
    a = make_req(list(range(64)))
    kv.assign(a)
    compute(kv, a, 48)
    kv.release(a)  # 48 tokens in the tree, evictable
    assert kv.available() == 64
    b = make_req(list(range(500, 564)), rid="b")
    kv.assign(b)
    compute(kv, b, 64)  # needs the tree's pages: evicted
    assert kv.tree.total_size() == 0
    c = make_req(list(range(900, 920)), rid="c")
    kv.assign(c)
    assert kv.alloc_extend(c, 1) is None  # nothing left to evict
    kv.unassign(c)
    kv.release(b)
    kv.check_integrity([])


@pytest.mark.parametrize("cache", [True, False])
def test_unassign_and_no_cache(cache):
    kv = make_kv(16, cache=cache)
    a = make_req(list(range(40)))
    kv.assign(a)
    compute(kv, a, 40)
    kv.release(a)
    assert kv.tree.total_size() == (32 if cache else 0)
    kv.check_integrity([])


def test_integrity_error_is_raised_not_asserted():
    """A leak is reported with a real exception (kept under `python -O`)."""
    kv = make_kv(1)
    a = make_req(list(range(10)))
    kv.assign(a)
    compute(kv, a, 10)
    with pytest.raises(KVIntegrityError, match="accounting broken"):
        kv.check_integrity([])  # `a` still holds 10 slots nobody accounts for
    kv.release(a)


def test_integrity_check_survives_python_O(tmp_path):
    import subprocess
    import sys
    code = ("from lmprog_runtime.cache.allocator import TokenSlotAllocator\n"
            "from lmprog_runtime.cache.radix import RadixCache, KVIntegrityError\n"
            "t = RadixCache(TokenSlotAllocator(64, 1))\n"
            "t._evictable += 1\n"
            "try:\n    t.check_integrity()\nexcept KVIntegrityError:\n    print('caught')\n")
    out = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "caught", out.stderr
