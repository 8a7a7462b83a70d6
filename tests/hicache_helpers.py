"""Helpers for the HiCache tests (importable from any test folder): a tiered tree over real
pools, KV derived from (token, position, layer), insert the way the scheduler does, audits."""

import torch

from lmprog_runtime.cache.allocator import TokenSlotAllocator
from lmprog_runtime.cache.hiradix import HiRadixCache
from lmprog_runtime.cache.host_pool import HostKVPool, TierIO
from lmprog_runtime.cache.kv_pool import TokenToKVPool

LAYERS, HEADS, DIM = 2, 1, 4


def make(device=64, host=128, page_size=1, policy="write_through", host_dtype=torch.float32, layerwise=False):
    dev_pool = TokenToKVPool(device, LAYERS, HEADS, DIM, torch.float32, page_size=page_size)
    host_pool = HostKVPool(host, LAYERS, HEADS, DIM, host_dtype, page_size)
    alloc, host_alloc = TokenSlotAllocator(device, page_size), TokenSlotAllocator(host, page_size)
    io = TierIO(dev_pool, host_pool, layerwise=layerwise)
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
    if pool.load_gate is not None:  # layer-wise load-backs: read only what they finished
        pool.load_gate.drain()
    for layer in range(LAYERS):
        want = kv_of(tokens, layer).to(dtype).to(torch.float32)
        assert torch.equal(pool.k[layer, slots], want)
        assert torch.equal(pool.v[layer, slots], -want)


def full_match(tree, tokens):
    m = tree.match_prefix(tokens)
    if m.host_len:
        m = tree.load_back(m, tree.allocator.alloc)
    return m
class DictStorage:
    """Storage for the tree tests: page bytes by key in a dict, written at backup time the
    way the controller does (every whole page whose tokens all have host copies)."""

    def __init__(self, tree, page_tokens):
        from lmprog_runtime.cache.hiradix import L3Index

        self.tree, self.S, self.pages = tree, page_tokens, {}
        tree.l3 = L3Index(page_tokens, lambda keys: all(k in self.pages for k in keys), 10_000)
        tree.on_backup = self.on_backup

    def on_backup(self, node):
        from lmprog_runtime.cache.storage import page_hashes

        path = self.tree.path_between(self.tree.root, node)
        if any(n.host_value is None for n in path):
            return
        tokens = [t for n in path for t in n.key]
        host = torch.cat([n.host_value for n in path])
        for i, key in enumerate(page_hashes(tokens, self.S, node.namespace)):
            self.pages.setdefault(key, self.tree.io.page_bytes(host[i * self.S:(i + 1) * self.S]))

    def prefetch(self, tokens, namespace=None):
        """What the Prefetcher does, synchronously: read the pages after what L1 + L2 hold
        into host slots and attach them; returns the tokens the tree took."""
        from lmprog_runtime.cache.storage import page_hashes

        S, tree = self.S, self.tree
        m = tree.match_prefix(tokens, namespace)
        first = (len(m.indices) + m.host_len) // S
        keys = page_hashes(tokens, S, namespace)[first:]
        keys = keys[:next((i for i, k in enumerate(keys) if k not in self.pages), len(keys))]
        if not keys:
            return 0
        slots = tree.alloc_host(len(keys) * S)
        assert slots is not None
        for i, k in enumerate(keys):
            tree.io.write_page(slots[i * S:(i + 1) * S], self.pages[k])
        end = (first + len(keys)) * S
        k = tree.insert_host(list(tokens[:end]), first * S, slots, namespace)
        tree.host_allocator.free(slots[:k])
        return len(slots) - k
