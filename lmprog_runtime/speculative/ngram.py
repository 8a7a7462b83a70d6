"""NGRAM drafts: a trie of the n-grams (n <= max_depth) of every running request's prompt
and output, shared by all requests, so recent requests feed each other's drafts.

A path root → ... → node spells an n-gram; `count` is how often it was seen and `best`
the most frequent next token (ties: the latest seen). A draft continues a request's
tokens: find the longest suffix of them (MIN_MATCH to max_depth - 1 tokens) that is a path
with a continuation, follow `best` children; at a leaf, match again with the drafted
tokens appended. A chain stops where its path's estimated probability (the product, per
drafted token, of how often it followed the last CONFIDENCE_CONTEXT tokens, of all the
continuations seen there) falls below MIN_PATH_PROB; where no suffix of MIN_MATCH tokens
matches, the last token alone may start it, discounted by SHORT_MATCH_PRIOR (so only a
token always followed by the same one drafts). With topk > 1 (`draft_tree`) the draft is
a tree: where a node has several continuations, up to topk of them (the most frequent
first) become children, and nodes join the tree best-first by their path's estimated
probability (the product of count(child) / count(all children) along the path) until the
tree holds k nodes or the next best path's probability is below MIN_PATH_PROB.

Memory is bounded by `capacity` nodes in two generations: new n-grams go to the current
trie; when it holds capacity / 2 nodes it becomes the previous one (the older previous is
dropped) and a fresh trie starts. Matching looks in the current trie, then the previous.
This is an LRU at the granularity of a generation. Costs per request and step: feeding a
token is max_depth node steps; a draft is at most a few suffix walks of <= max_depth steps.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Dict, List, Optional, Sequence, Tuple

from lmprog_runtime.speculative.base import Draft, DraftSource


# A draft needs at least this many tokens of matching context: a single common token
# (" the", a comma) predicts its continuation too poorly to pay for verifying it.
MIN_MATCH = 2
# A chain draft stops where its path's estimated probability would fall below this.
MIN_PATH_PROB = 0.4
# Where no context of MIN_MATCH tokens matches, a chain may start from the last token alone,
# its probability discounted by this: it survives only where that token has (nearly) always
# been followed by the same one (a name copied from the prompt into a JSON value: 'Alice'
# → ' Martin', where the tokens before differ), never after a common token (' the', ',').
SHORT_MATCH_PRIOR = 0.5
# The context whose continuation counts give a drafted token's probability.
CONFIDENCE_CONTEXT = 4


class _Node:
    __slots__ = ("children", "count", "best", "total")

    def __init__(self):
        self.children: Optional[Dict[int, "_Node"]] = None
        self.count = 0
        self.best = -1  # token id of the most frequent child, -1 = none
        self.total = 0  # sum of the children's counts

    def child(self, token: int) -> Optional["_Node"]:
        return None if self.children is None else self.children.get(token)


class _SeqState:
    """Where one request's tokens stand in the current trie."""

    __slots__ = ("gen", "open", "fed", "last")

    def __init__(self, gen: int):
        self.gen = gen
        self.open: List[_Node] = []  # open[j]: node of the last j + 1 tokens (depth j + 1 < max_depth)
        self.fed = 0                 # tokens of the request inserted so far
        self.last = -1               # the last token inserted (detects a rewritten tail)


class NgramCorpus:
    def __init__(self, max_depth: int, capacity: int):
        self.max_depth = max_depth
        self.capacity = capacity
        self.current = _Node()
        self.previous: Optional[_Node] = None
        self.gen = 0
        self.nodes = 0  # nodes of the current generation
        self._tie = itertools.count()  # heap tie-breaker: earlier pushes first

    # -- insertion ------------------------------------------------------------------------
    def feed(self, state: _SeqState, tokens: Sequence[int]) -> None:
        """Insert the n-grams ending at tokens[state.fed:] (tokens: the whole sequence)."""
        if state.gen != self.gen or len(tokens) < state.fed or (
                state.fed and tokens[state.fed - 1] != state.last):
            # rotated trie or rewritten tail: restart from the last max_depth - 1 tokens
            state.gen, state.open = self.gen, []
            state.fed = max(0, min(state.fed, len(tokens)) - (self.max_depth - 1))
        for t in tokens[state.fed:]:
            self._push(state, t)
            if self.nodes >= self.capacity // 2:
                self._rotate()
                state.gen, state.open = self.gen, []  # n-grams across the cut are lost
        state.fed = len(tokens)
        if tokens:
            state.last = tokens[-1]

    def _push(self, state: _SeqState, token: int) -> None:
        grown = []
        for parent in [self.current] + state.open:
            node = self._add_child(parent, token)
            if len(grown) + 1 < self.max_depth:  # depth of `node` is len(grown) + 1
                grown.append(node)
        state.open = grown

    def _add_child(self, parent: _Node, token: int) -> _Node:
        if parent.children is None:
            parent.children = {}
        node = parent.children.get(token)
        if node is None:
            node = parent.children[token] = _Node()
            self.nodes += 1
        node.count += 1
        parent.total += 1
        if parent.best < 0 or node.count >= parent.children[parent.best].count:
            parent.best = token
        return node

    def _rotate(self) -> None:
        self.previous, self.current = self.current, _Node()
        self.gen += 1
        self.nodes = 0

    # -- drafting -------------------------------------------------------------------------
    def draft(self, tail: List[int], k: int) -> List[int]:
        """Up to k tokens continuing `tail` (the sequence's last tokens), ending where the
        path's estimated probability (the product of each token's `_share`) falls below
        MIN_PATH_PROB: past a point where the corpus has seen many different continuations
        (a JSON value after its key: the previous requests' values) every drafted row is
        likely wasted."""
        out: List[int] = []
        p = 1.0
        while len(out) < k:
            node, _ = self._deepest_match(tail + out)
            if node is None:  # the last token alone (SHORT_MATCH_PRIOR)
                node, _ = self._deepest_match((tail + out)[-1:], 1)
                p *= SHORT_MATCH_PRIOR
            if node is None:
                break
            before = len(out)
            while len(out) < k and node.best >= 0:
                child = node.children[node.best]
                p *= self._share(tail + out, node.best, child.count / node.total)
                if p < MIN_PATH_PROB:
                    return out
                out.append(node.best)
                node = child
            if len(out) == before:
                break
        return out

    def _share(self, seq: List[int], token: int, deep: float) -> float:
        """How often `token` followed the last CONFIDENCE_CONTEXT tokens of `seq`, of all
        continuations seen there (the deepest context matched is often one earlier request,
        whose single continuation says p = 1); `deep` where that context is not in the
        current trie."""
        node = self.current
        for t in seq[-CONFIDENCE_CONTEXT:]:
            node = node.child(t)
            if node is None:
                return deep
        child = node.child(token)
        return deep if child is None else child.count / node.total

    def draft_tree(self, tail: List[int], k: int, topk: int) -> Tuple[List[int], List[int]]:
        """Up to k tree nodes continuing `tail`: (tokens, parents), parents[j] < j the index
        of node j's parent, -1 = the last token of `tail`. Best-first (see the docstring);
        a node whose path probability is below MIN_PATH_PROB is not drawn (each node costs
        a verify row)."""
        tokens: List[int] = []
        parents: List[int] = []
        paths: List[List[int]] = []  # paths[j]: tokens from the root to node j, inclusive
        heap: list = []  # (-probability, tie, parent index, token, trie node of the token)
        self._push_children(heap, self._deepest_match(tail)[0], 1.0, -1, topk)
        while heap and len(tokens) < k and -heap[0][0] >= MIN_PATH_PROB:
            neg_p, _, parent, token, node = heapq.heappop(heap)
            j = len(tokens)
            tokens.append(token)
            parents.append(parent)
            paths.append((paths[parent] if parent >= 0 else []) + [token])
            if node.best < 0:  # a leaf: match again with the path appended
                node = self._deepest_match(tail + paths[j])[0]
            self._push_children(heap, node, -neg_p, j, topk)
        return tokens, parents

    def _push_children(self, heap: list, node: Optional[_Node], prob: float, parent: int, topk: int) -> None:
        """The topk most frequent children of `node` (its `best` first) under `parent`."""
        if node is None or node.best < 0:
            return
        kids = node.children
        total = sum(c.count for c in kids.values())
        top = heapq.nlargest(topk, kids.items(), key=lambda kv: (kv[0] == node.best, kv[1].count))
        for token, child in top:
            heapq.heappush(heap, (-prob * child.count / total, next(self._tie), parent, token, child))

    def _deepest_match(self, seq: List[int], least: int = MIN_MATCH) -> Tuple[Optional[_Node], int]:
        """(the node of the longest suffix of `seq` (least .. max_depth - 1 tokens) that has
        a child, that suffix's length); (None, 0) when there is none."""
        longest = min(len(seq), self.max_depth - 1)
        for root in (self.current, self.previous):
            if root is None:
                continue
            for m in range(longest, least - 1, -1):
                node = root
                for t in seq[len(seq) - m:]:
                    node = node.child(t)
                    if node is None:
                        break
                if node is not None and node.best >= 0:
                    return node, m
        return None, 0


class NgramDraftSource(DraftSource):
    cheap = True  # a trie lookup per request

    def __init__(self, max_depth: int = 18, capacity: int = 1_000_000, topk: int = 1):
        self.corpus = NgramCorpus(max_depth, capacity)
        self.topk = topk  # 1: chains; > 1: trees of up to topk children per node
        self.states: Dict[str, _SeqState] = {}

    def propose(self, reqs: Sequence, budgets: Sequence[int], prefixes=None) -> List[Optional[Draft]]:
        out: List[Optional[Draft]] = []
        depth = self.corpus.max_depth
        for i, (r, k) in enumerate(zip(reqs, budgets)):
            state = self.states.get(r.rid)
            if state is None:
                state = self.states[r.rid] = _SeqState(self.corpus.gen)
            tokens = r.origin_input_ids + r.output_ids
            self.corpus.feed(state, tokens)  # verified tokens only: a prefix is not fed
            tail = (tokens[-(depth - 1):] + list(prefixes[i] if prefixes else ()))[-(depth - 1):]
            if self.topk == 1:
                tokens = self.corpus.draft(tail, k)
                out.append(Draft(tokens) if tokens else None)
            else:
                tokens, parents = self.corpus.draft_tree(tail, k, self.topk)
                out.append(Draft(tokens, parents) if tokens else None)
        return out

    def release(self, req) -> None:
        self.states.pop(req.rid, None)

    def flush(self) -> None:
        self.corpus = NgramCorpus(self.corpus.max_depth, self.corpus.capacity)
        self.states.clear()
