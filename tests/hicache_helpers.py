"""Helpers for the HiCache tests (importable from any test folder): a tiered tree over real
pools, KV derived from (token, position, layer), insert the way the scheduler does, audits."""

import torch

from lmprog_runtime.cache.allocator import TokenSlotAllocator
from lmprog_runtime.cache.hiradix import HiRadixCache
from lmprog_runtime.cache.host_pool import HostKVPool, TierIO
from lmprog_runtime.cache.kv_pool import TokenToKVPool

LAYERS, HEADS, DIM = 2, 1, 4


def make(device=64, host=128, page_size=1, policy="write_through", host_dtype=torch.float32):
    dev_pool = TokenToKVPool(device, LAYERS, HEADS, DIM, torch.float32, page_size=page_size)
    host_pool = HostKVPool(host, LAYERS, HEADS, DIM, host_dtype, page_size)
    alloc, host_alloc = TokenSlotAllocator(device, page_size), TokenSlotAllocator(host, page_size)
    io = TierIO(dev_pool, host_pool)
    tree = HiRadixCache(alloc, host_alloc, io, page_size, policy)
    return tree, dev_pool


def audit(tree):
    tree.check_integrity()
    assert tree.allocator.available_size() + tree.total_size() == tree.allocator.size
    assert tree.host_allocator.available_size() + tree.host_total_size() == tree.host_allocator.size


def put(tree, pool, tokens, namespace=None):
    """Compute KV for `tokens` (a value derived from the token and its position), insert it
    like the scheduler does and free what the tree did not take; returns the slots used."""
    alloc = tree.allocator
    slots = alloc.alloc(len(tokens))
    if slots is None:
        tree.evict(len(tokens) - alloc.available_size())
        slots = alloc.alloc(len(tokens))
    assert slots is not None
    for layer in range(LAYERS):
        kv = kv_of(tokens, layer)
        pool.set_kv(layer, slots, kv, -kv)
    resident = tree.insert(tokens, slots, namespace)
    alloc.free(slots[:resident])
    audit(tree)
    return slots


def kv_of(tokens, layer):
    t = torch.tensor(tokens, dtype=torch.float32)
    pos = torch.arange(len(tokens), dtype=torch.float32)
    return (t[:, None, None] * 1.001 + pos[:, None, None] * 0.37 + layer + torch.arange(DIM) / 7).expand(
        len(tokens), HEADS, DIM).contiguous()


def assert_kv(pool, slots, tokens, dtype=torch.float32):
    for layer in range(LAYERS):
        want = kv_of(tokens, layer).to(dtype).to(torch.float32)
        assert torch.equal(pool.k[layer, slots], want)
        assert torch.equal(pool.v[layer, slots], -want)


def full_match(tree, tokens):
    m = tree.match_prefix(tokens)
    if m.host_len:
        m = tree.load_back(m, tree.allocator.alloc)
    return m
