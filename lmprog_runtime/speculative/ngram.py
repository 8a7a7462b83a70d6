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
token always followed by the same one drafts). A chain also looks in the request's own
prompt (`PromptIndex`): what it copies from there (an extraction's values) follows the
prompt, not the other requests' n-grams, for as long as outputs tend to copy (`copy_rate`,
learned from the outputs); and it drafts only tokens the request's grammar allows
(`allows`, from the speculator's GrammarGuide). With topk > 1 (`draft_tree`) the draft is
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
from typing import Callable, Dict, List, Optional, Sequence, Tuple

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
# A token copied from the prompt after a match of n tokens there is drafted with probability
# the rate at which outputs went on copying after such matches: an extraction's value ends
# where the prompt goes on (`"Emma Stone` → `",`, not ` is`), a quote does not. An EMA per n
# (COPY_DECAY per observation), starting from COPY_PRIOR copies seen and none missed.
COPY_DECAY = 0.95
COPY_PRIOR = 2.0
# The context whose continuation counts give a drafted token's probability.
CONFIDENCE_CONTEXT = 4

# allows(draft, token): may `token` follow `draft` (the request's grammar, guide.py)?
Allows = Callable[[List[int], int], bool]


def _anything(draft: List[int], token: int) -> bool:
    return True


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

    __slots__ = ("gen", "open", "fed", "last", "prompt", "observed")

    def __init__(self, gen: int, prompt: Optional["PromptIndex"] = None):
        self.gen = gen
        self.prompt = prompt         # the request's own prompt (chains match it too)
        self.observed = 0            # tokens whose copying from the prompt was counted
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
        self.copies = [[0.0, 0.0] for _ in range(max_depth)]  # n -> [EMA copied, EMA matched]

    def observe_copies(self, prompt: "PromptIndex", tokens: Sequence[int], start: int) -> None:
        """Count, for tokens[start:], whether each followed the prompt after a match there of
        MIN_MATCH+ tokens (per match length: `copy_rate`)."""
        for i in range(start, len(tokens)):
            at, n = prompt.match(tokens[max(0, i - self.max_depth + 1):i], self.max_depth - 1)
            if n >= MIN_MATCH:
                stat = self.copies[n]
                stat[0] = COPY_DECAY * stat[0] + (tokens[i] == prompt.tokens[at])
                stat[1] = COPY_DECAY * stat[1] + 1.0

    def copy_rate(self, n: int) -> float:
        """How often outputs went on copying the prompt after a match of n tokens there."""
        copied, matched = self.copies[n]
        return (copied + COPY_PRIOR) / (matched + COPY_PRIOR)

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
        """Count `token` under the root and under every open node (a child made where
        missing, each parent's `best` kept), in one loop: a token's max_depth insertions are
        most of a step's feeding."""
        grown = []
        keep = self.max_depth - 1  # open nodes have depth < max_depth
        for parent in [self.current] + state.open:
            kids = parent.children
            if kids is None:
                kids = parent.children = {}
            node = kids.get(token)
            if node is None:
                node = kids[token] = _Node()
                self.nodes += 1
            node.count += 1
            parent.total += 1
            if parent.best < 0 or node.count >= kids[parent.best].count:
                parent.best = token
            if len(grown) < keep:  # depth of `node` is len(grown) + 1
                grown.append(node)
        state.open = grown

    def _rotate(self) -> None:
        self.previous, self.current = self.current, _Node()
        self.gen += 1
        self.nodes = 0

    # -- drafting -------------------------------------------------------------------------
    def draft(self, tail: List[int], k: int, prompt: Optional["PromptIndex"] = None,
              allows: Optional[Allows] = None) -> List[int]:
        """Up to k tokens continuing `tail` (the sequence's last tokens), ending where the
        path's estimated probability (the product of each token's `_share`) falls below
        MIN_PATH_PROB: past a point where the corpus has seen many different continuations
        (a JSON value after its key: the previous requests' values) every drafted row is
        likely wasted. Each token is the trie's (its deepest context matched, else the last
        token alone, discounted by SHORT_MATCH_PRIOR) or the request's `prompt`'s (see
        `_next`). `allows(draft, token)`: whether the request's grammar allows `token` after
        `draft`; only such tokens are drafted (shares are then of the allowed continuations)."""
        ok = allows or _anything
        out: List[int] = []
        p = 1.0
        node = (None, 0)  # the trie node being followed, the length of the context it spells
        while len(out) < k:
            token, share, node = self._next(tail + out, out, node, prompt, ok)
            p *= share
            if token < 0 or p < MIN_PATH_PROB:
                break
            out.append(token)
        return out

    def _next(self, seq: List[int], out: List[int], node: Tuple[Optional[_Node], int],
              prompt: Optional["PromptIndex"], ok: Allows):
        """(next token or -1, its probability, (the trie node to follow after it, its
        context length)). The prompt's continuation (probability `copy_rate`) competes with
        the trie's where the prompt matches MIN_MATCH+ tokens and no fewer than the trie
        (which holds the prompt too: a longer match there is other text that went the same
        way for longer, e.g. an earlier answer to the same question); the more probable
        wins. A trie token the prompt never holds has its probability squared: at a
        branching point that is another request's value."""
        at, n = prompt.match(seq, self.max_depth - 1) if prompt is not None else (-1, 0)
        copied = prompt.tokens[at] if n and ok(out, prompt.tokens[at]) else -1
        trie, depth = node
        if trie is None or self._pick(trie, out, ok) is None:
            trie, depth = self._deepest_match(seq, MIN_MATCH, out, ok)
        best = None
        if trie is not None:
            token, child, share = self._pick(trie, out, ok)
            share = self._share(seq, token, share, out, ok)
            if prompt is not None and token not in prompt.at:
                share *= share  # past `"name": "`: another request's value (1/2 → 1/4)
            best = token, share, (child, depth + 1)
        if copied >= 0 and n >= max(MIN_MATCH, depth) and (best is None or self.copy_rate(n) >= best[1]):
            return copied, self.copy_rate(n), (None, 0)
        if best is not None:
            return best
        trie, _ = self._deepest_match(seq[-1:], 1, out, ok)
        if trie is None:
            return -1, 1.0, (None, 0)
        token, child, share = self._pick(trie, out, ok)
        return token, SHORT_MATCH_PRIOR * self._share(seq, token, share, out, ok), (child, 2)

    @staticmethod
    def _pick(node: _Node, out: List[int], ok: Allows):
        """(the most frequent allowed child's token, its node, its share of the allowed
        children's counts), or None."""
        if node.best < 0:
            return None
        if ok is _anything:
            return node.best, node.children[node.best], node.children[node.best].count / node.total
        allowed = [(c.count, t, c) for t, c in node.children.items() if ok(out, t)]
        if not allowed:
            return None
        count, token, child = max(allowed, key=lambda ctc: (ctc[0], ctc[1] == node.best))
        return token, child, count / sum(c for c, _, _ in allowed)

    def _share(self, seq: List[int], token: int, deep: float, out: List[int], ok: Allows) -> float:
        """How often `token` followed the last CONFIDENCE_CONTEXT tokens of `seq`, of all
        (allowed) continuations seen there (the deepest context matched is often one earlier
        request, whose single continuation says p = 1); `deep` where that context is not in
        the current trie."""
        node = self.current
        for t in seq[-CONFIDENCE_CONTEXT:]:
            node = node.child(t)
            if node is None:
                return deep
        child = node.child(token)
        if child is None:
            return deep
        if ok is _anything:
            return child.count / node.total
        return child.count / sum(c.count for t, c in node.children.items() if ok(out, t))

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

    def _deepest_match(self, seq: List[int], least: int = MIN_MATCH, out: Optional[List[int]] = None,
                       ok: Optional[Allows] = None) -> Tuple[Optional[_Node], int]:
        """(the node of the longest suffix of `seq` (least .. max_depth - 1 tokens) that has
        a child (one `ok(out, token)` allows, when given), that suffix's length); (None, 0)
        when there is none."""
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
                if node is not None and node.best >= 0 and (ok is None or self._pick(node, out, ok)):
                    return node, m
        return None, 0


class PromptIndex:
    """Where each token of one request's prompt occurs. What a request copies from its own
    prompt (a JSON extraction's values, a quote) follows the prompt there, while the shared
    trie may have seen other requests' values after the same context (`"age": 4` → the
    previous record's digits), so a chain weighs the prompt's continuation too
    (`NgramCorpus._next`)."""

    __slots__ = ("tokens", "at")

    def __init__(self, tokens: Sequence[int]):
        self.tokens = list(tokens)
        self.at: Dict[int, List[int]] = {}  # token -> its positions that have a next token
        for i, t in enumerate(self.tokens[:-1]):
            self.at.setdefault(t, []).append(i)

    def match(self, seq: List[int], longest: int) -> Tuple[int, int]:
        """(index of the prompt token after the longest suffix of `seq` (1..longest tokens)
        found in the prompt, that suffix's length); (-1, 0) when the last token is not in
        the prompt, or where the longest matches go on differently (a question quoting its
        document: the trie's counts decide there)."""
        best, n, clash = -1, 0, False
        for i in self.at.get(seq[-1], ()):
            m = 1
            while m < min(longest, len(seq), i + 1) and self.tokens[i - m] == seq[-1 - m]:
                m += 1
            if m > n:
                best, n, clash = i + 1, m, False
            elif m == n:
                clash = clash or self.tokens[i + 1] != self.tokens[best]
        return (-1, 0) if clash else (best, n)


class NgramDraftSource(DraftSource):
    cheap = True  # a trie lookup per request
    guided = True  # chains draft only tokens the request's grammar allows

    def __init__(self, max_depth: int = 18, capacity: int = 1_000_000, topk: int = 1):
        self.corpus = NgramCorpus(max_depth, capacity)
        self.topk = topk  # 1: chains; > 1: trees of up to topk children per node
        self.states: Dict[str, _SeqState] = {}

    def propose(self, reqs: Sequence, budgets: Sequence[int], prefixes=None, guides=None) -> List[Optional[Draft]]:
        out: List[Optional[Draft]] = []
        depth = self.corpus.max_depth
        for i, (r, k) in enumerate(zip(reqs, budgets)):
            state = self.states.get(r.rid)
            if state is None:
                state = self.states[r.rid] = _SeqState(self.corpus.gen, PromptIndex(r.origin_input_ids))
            tokens = r.origin_input_ids + r.output_ids
            self.corpus.observe_copies(state.prompt, tokens, max(state.observed, len(r.origin_input_ids)))
            state.observed = len(tokens)
            self.corpus.feed(state, tokens)  # verified tokens only: a prefix is not fed
            tail = (tokens[-(depth - 1):] + list(prefixes[i] if prefixes else ()))[-(depth - 1):]
            if self.topk == 1:
                guide = guides[i] if guides else None
                tokens = self.corpus.draft(tail, k, state.prompt, guide and guide.allows)
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
