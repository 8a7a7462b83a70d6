"""Synthetic radix trees for the Inspector's tests (tree_view, the browser test, the bench)."""

from __future__ import annotations

import random

from lmprog_runtime.cache.allocator import TokenSlotAllocator
from lmprog_runtime.cache.radix import RadixCache


def decode(ids) -> str:
    return "".join(chr(97 + t % 26) for t in ids)


def put(alloc, tree, tokens, namespace=None) -> None:
    """Insert like the scheduler does: allocate, insert, free what the tree already had."""
    kv = alloc.alloc(len(tokens))
    already = tree.insert(tokens, kv, namespace)
    alloc.free(kv[:already])


def random_tree(n_seqs: int, seed: int = 0, size: int = 1 << 16, vocab: int = 6, length=(4, 24)):
    """(allocator, tree, sequences): branchy sequences over a tiny vocabulary, so many
    prefixes are shared and many nodes split; some old paths are matched again, so LRU
    order differs from insertion order."""
    rng = random.Random(seed)
    alloc = TokenSlotAllocator(size)
    tree = RadixCache(alloc)
    seqs: list = []
    for _ in range(n_seqs):
        base = rng.choice(seqs) if seqs and rng.random() < 0.7 else []
        cut = rng.randint(0, len(base))
        seq = base[:cut] + [rng.randrange(vocab) for _ in range(rng.randint(*length))]
        put(alloc, tree, seq)
        seqs.append(seq)
        if rng.random() < 0.3:
            tree.match_prefix(rng.choice(seqs))
    return alloc, tree, seqs


def tree_of_at_least(num_nodes: int, seed: int = 0):
    """A random tree with at least `num_nodes` nodes (inserting until it has them)."""
    n = max(16, num_nodes // 2)
    while True:
        alloc, tree, seqs = random_tree(n, seed=seed, size=1 << 22, vocab=50, length=(2, 12))
        if sum(1 for _ in tree.nodes()) >= num_nodes:
            return alloc, tree, seqs
        n = n * 3 // 2
