"""Property test: random insert/match/lock/unlock/evict sequences against a naive model.

The model keeps, per namespace, every cached page-aligned prefix with the KV slots of
its last page and a logical access time (one tick per match/insert, set on every page
the call walked). Matches must agree exactly; evictions are checked for what they may
remove (unlocked pages only, least recently used first, no more than needed), and the
memory accounting and `check_integrity()` are audited after every step.
"""

import torch
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from lmprog_runtime.cache.allocator import TokenSlotAllocator
from lmprog_runtime.cache.radix import RadixCache

NAMESPACES = [None, "salt", ("salt", "lora")]
BASES = [(0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2, 0),
         (0, 1, 2, 0, 2, 2, 1, 1, 0, 0, 1, 2, 2, 2, 1, 0),
         (1, 1, 1, 1, 0, 0, 0, 0, 2, 2, 2, 2, 1, 1, 1, 1)]


@st.composite
def token_lists(draw):
    """A base sequence cut anywhere plus a short random tail: shared prefixes and splits."""
    base = draw(st.sampled_from(BASES))
    cut = draw(st.integers(0, len(base)))
    return list(base[:cut]) + draw(st.lists(st.integers(0, 2), max_size=8))


def tree_content(tree):
    """{(namespace, page-aligned prefix): slots of its last page} read off the tree."""
    p, out = tree.page_size, {}
    stack = [(child, ()) for child in tree.root.children.values()]
    while stack:
        node, prefix = stack.pop()
        for i in range(0, len(node.key), p):
            out[(node.namespace, prefix + node.key[:i + p])] = tuple(node.value[i:i + p].tolist())
        stack.extend((child, prefix + node.key) for child in node.children.values())
    return out


def make_machine(page_size: int, size: int):
    class RadixMachine(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            self.p = page_size
            self.alloc = TokenSlotAllocator(size, page_size)
            self.tree = RadixCache(self.alloc, page_size=page_size)
            self.model = {}      # (ns, prefix) -> [slots of the last page, access time]
            self.clock = 0
            self.locks = []      # (node, ns, matched prefix)
            self.outside = []    # slot tensors the "scheduler" still holds

        # -------------------------------------------------------- the model
        def pages(self, tokens):
            return [tuple(tokens[:j]) for j in range(self.p, len(tokens) + 1, self.p)]

        def model_walk(self, ns, tokens):
            """Touch and return the cached pages of `tokens`, longest prefix first-to-last."""
            self.clock += 1
            hit = []
            for prefix in self.pages(tokens):
                entry = self.model.get((ns, prefix))
                if entry is None:
                    break
                entry[1] = self.clock
                hit.append(entry[0])
            return hit

        def locked_pages(self):
            return {(ns, prefix) for _, ns, key in self.locks for prefix in self.pages(key)}

        # ------------------------------------------------------------ rules
        @rule(ns=st.sampled_from(NAMESPACES), tokens=token_lists(), hold=st.booleans())
        def insert(self, ns, tokens, hold):
            need = -(-len(tokens) // self.p) * self.p
            if need > self.alloc.available_size():
                self.do_evict(need - self.alloc.available_size())
            kv = self.alloc.alloc(need)
            if kv is None:
                return
            already = self.tree.insert(tokens, kv[:len(tokens)], ns)
            hit = self.model_walk(ns, tokens)
            assert already == len(hit) * self.p, (already, hit)
            for j, prefix in enumerate(self.pages(tokens)[len(hit):], start=len(hit)):
                self.model[(ns, prefix)] = [tuple(kv[j * self.p:(j + 1) * self.p].tolist()), self.clock]
            aligned = len(tokens) - len(tokens) % self.p
            mine = torch.cat([kv[:already], kv[aligned:]])  # duplicates and the partial page
            if hold:
                self.outside.append(mine)
            else:
                self.alloc.free(mine)

        @rule(ns=st.sampled_from(NAMESPACES), tokens=token_lists())
        def match(self, ns, tokens):
            result = self.tree.match_prefix(tokens, ns)
            hit = self.model_walk(ns, tokens)
            assert result.indices.tolist() == [s for page in hit for s in page]
            # last_node ends exactly at the match
            key, node = (), result.last_node
            while node is not self.tree.root:
                assert node.namespace == ns
                key, node = node.key + key, node.parent
            assert key == tuple(tokens[:len(hit) * self.p])

        @rule(ns=st.sampled_from(NAMESPACES), tokens=token_lists())
        def lock(self, ns, tokens):
            result = self.tree.match_prefix(tokens, ns)
            hit = self.model_walk(ns, tokens)
            self.tree.inc_lock_ref(result.last_node)
            self.locks.append((result.last_node, ns, tuple(tokens[:len(hit) * self.p])))

        @precondition(lambda self: self.locks)
        @rule(which=st.integers(0, 1 << 16))
        def unlock(self, which):
            node, _, _ = self.locks.pop(which % len(self.locks))
            self.tree.dec_lock_ref(node)

        @rule(num_tokens=st.integers(0, 24))
        def evict(self, num_tokens):
            self.do_evict(num_tokens)

        @precondition(lambda self: self.outside)
        @rule()
        def release_outside(self):
            for slots in self.outside:
                self.alloc.free(slots)
            self.outside = []

        def do_evict(self, num_tokens):
            before = tree_content(self.tree)
            assert before.keys() == self.model.keys()
            available = self.alloc.available_size()
            freed = self.tree.evict(num_tokens)
            after = tree_content(self.tree)
            removed = before.keys() - after.keys()
            assert all(before[k] == v for k, v in after.items()), "surviving slots changed"
            assert freed == len(removed) * self.p == self.alloc.available_size() - available
            assert not removed & self.locked_pages(), "evicted a locked page"
            if freed < num_tokens:
                assert self.tree.evictable_size() == 0, "stopped early with evictable tokens left"
            if removed:
                times = [self.model[k][1] for k in removed]
                last = max(times)
                # no more than needed: the nodes of the last access time tipped it over
                assert freed - self.p * times.count(last) < num_tokens
                # LRU: every remaining unlocked leaf page is at least as recent
                locked = self.locked_pages()
                for ns, prefix in after:
                    leaf = not any((ns, prefix + tail) in after for tail in self.next_pages(prefix, ns, after))
                    if leaf and (ns, prefix) not in locked:
                        assert self.model[(ns, prefix)][1] >= last, "evicted a newer leaf first"
            for k in removed:
                del self.model[k]

        def next_pages(self, prefix, ns, content):
            return {k[1][len(prefix):] for k in content
                    if k[0] == ns and len(k[1]) == len(prefix) + self.p and k[1][:len(prefix)] == prefix}

        # ------------------------------------------------------- invariants
        @invariant()
        def accounting(self):
            tree, p = self.tree, self.p
            tree.check_integrity()
            held = sum(len(s) for s in self.outside)
            assert self.alloc.available_size() + tree.total_size() + held == self.alloc.size
            assert tree.evictable_size() + tree.protected_size() == tree.total_size()
            assert tree.total_size() == len(self.model) * p
            assert tree.protected_size() == len(self.locked_pages()) * p

        def teardown(self):
            for node, _, _ in self.locks:
                self.tree.dec_lock_ref(node)
            self.tree.reset()
            for slots in self.outside:
                self.alloc.free(slots)
            assert self.alloc.available_size() == self.alloc.size

    RadixMachine.TestCase.settings = settings(
        max_examples=60, stateful_step_count=40, deadline=None,
        suppress_health_check=[HealthCheck.too_slow])
    return RadixMachine


TestRadixPage1 = make_machine(page_size=1, size=40).TestCase
TestRadixPage2 = make_machine(page_size=2, size=48).TestCase
TestRadixPage4 = make_machine(page_size=4, size=64).TestCase
