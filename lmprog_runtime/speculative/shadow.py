"""Shadow drafts: what a request the cost rule keeps from verifying would have drafted,
checked against the tokens its plain steps then produce. This measures the request's
acceptance without paying for a verify forward (it replaced a probe verify every 32 idle
steps, which at batch 16 on a CPU cost about two plain steps each).

A shadow is the draft's main chain (a tree: from the root, each node's first child — the
most probable, as draft trees are built best-first) and the output length when it was
made. It is decided once the output has grown past its first mismatch or its whole
length: `matched` tokens of its `reach` agreed. Under greedy decoding that is exactly what
a verify would have accepted; under sampling a drafted token matches the sampled one with
probability p(d), the same as rejection sampling accepts it, so the estimate is unbiased.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple


class Shadow:
    __slots__ = ("start", "tokens")

    def __init__(self, start: int, tokens: List[int]):
        self.start = start      # len(output_ids) when drafted: tokens[0] predicts output_ids[start]
        self.tokens = tokens    # the chain, len >= 1

    def resolve(self, output_ids: Sequence[int]) -> Optional[Tuple[int, int]]:
        """(reach, matched) once decided, else None (the output has not gone far enough)."""
        new = output_ids[self.start:self.start + len(self.tokens)]
        matched = 0
        while matched < len(new) and new[matched] == self.tokens[matched]:
            matched += 1
        if matched == len(new) < len(self.tokens):
            return None  # every token so far agrees, more are to come
        return len(self.tokens), matched


def make_shadow(start: int, tokens: List[int], parents: Optional[List[int]]) -> Optional[Shadow]:
    """A draft made when the output had `start` tokens, as a shadow (None if empty)."""
    chain = main_chain(tokens, parents)
    return Shadow(start, chain) if chain else None


def main_chain(tokens: List[int], parents: Optional[List[int]]) -> List[int]:
    """A chain's tokens; of a tree, the path of first children from the root."""
    if parents is None:
        return list(tokens)
    path, node = [], -1
    for j, p in enumerate(parents):
        if p == node:
            path.append(tokens[j])
            node = j
    return path
