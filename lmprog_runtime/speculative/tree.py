"""Draft trees: the shapes a verify step needs from `parents` (base.py's `Draft`).

A tree of k drafts is `parents` [k]: parents[j] < j is the index of node j's parent, -1
the root (the request's last verified token). Node j's depth is 1 + its parent's (the
root's children have depth 1), so it sits at position `root position + depth(j)`; its KV
slot is the (j + 1)-th after the root's (drafts keep their index order in the forward).
A chain is parents [-1, 0, 1, ...] (or None).
"""

from __future__ import annotations

from typing import List

import numpy as np
import torch


def chain_parents(k: int) -> List[int]:
    return list(range(-1, k - 1))


def depths(parents: List[int]) -> List[int]:
    """depth of every node: 1 for the root's children."""
    out: List[int] = []
    for p in parents:
        out.append(1 if p < 0 else out[p] + 1)
    return out


def path_to(parents: List[int], j: int) -> List[int]:
    """Node indices from the root's child down to node j (inclusive)."""
    path = []
    while j >= 0:
        path.append(j)
        j = parents[j]
    return path[::-1]


def children(parents: List[int]) -> List[List[int]]:
    """children[0] = the root's, children[j + 1] = node j's, each in index order."""
    out: List[List[int]] = [[] for _ in range(len(parents) + 1)]
    for j, p in enumerate(parents):
        out[p + 1].append(j)
    return out


def extend_mask(parents: List[int], lead: int) -> torch.Tensor:
    """bool [lead + k, lead + k]: which of a request's new tokens each new token sees. The
    first `lead` (its pending verified tokens, the root last) are causal; draft j sees all
    of them, its ancestors and itself. (The cached prefix is seen by every token.)"""
    k = len(parents)
    n = lead + k
    mask = torch.zeros((n, n), dtype=torch.bool)
    mask[:, :lead] = torch.ones((n, lead), dtype=torch.bool).tril()
    for j, p in enumerate(parents):
        row = lead + j
        if p >= 0:
            mask[row, lead:] = mask[lead + p, lead:]
        mask[row, row] = True
    return mask


def keep_nodes(tokens: List[int], parents: List[int], keep: List[bool]):
    """The subtree of kept nodes (a node is kept only with its parent): (tokens, parents)
    renumbered in the same order."""
    new_index: List[int] = []
    out_t, out_p = [], []
    for j, (t, p) in enumerate(zip(tokens, parents)):
        if keep[j] and (p < 0 or new_index[p] >= 0):
            new_index.append(len(out_t))
            out_t.append(t)
            out_p.append(-1 if p < 0 else new_index[p])
        else:
            new_index.append(-1)
    return out_t, out_p


def well_formed(tokens: List[int], parents: List[int]):
    """A source's tree with what verification relies on: parents[j] < j and distinct tokens
    among siblings (tree rejection sampling is exact only then). Offending nodes (and their
    subtrees) are dropped: (tokens, parents)."""
    seen = set()
    keep = []
    for j, (t, p) in enumerate(zip(tokens, parents)):
        ok = -1 <= p < j and (p, t) not in seen
        seen.add((p, t))
        keep.append(ok)
    return keep_nodes(tokens, parents, keep)


def grammar_tree_draft(g, tokens: List[int], parents: List[int], vocab_size: int, cut_after=None):
    """A tree's version of jump_forward.grammar_draft: (tokens, parents, mask) of the nodes
    the grammar allows (a node only with its parent), cut before a token after which the
    grammar terminates or `cut_after(g)` holds; mask bool [kept + 1, vocab_size], row 0 the
    mask after the verified tokens, row j + 1 after the path to kept node j. The matcher
    walks each node's path from the root and rolls back exactly."""
    k = len(tokens)
    rows = np.empty((k + 1, vocab_size), dtype=np.bool_)
    g.write_mask(rows[0])
    ok = [False] * k
    for j in range(k):
        p = parents[j]
        if p >= 0 and not ok[p]:
            continue
        t = tokens[j]
        if not (0 <= t < vocab_size and rows[p + 1][t]):
            continue
        path = [tokens[i] for i in path_to(parents, j)]
        walked = 0
        try:
            for x in path:
                g.accept_token(x)
                walked += 1
            if not (g.is_terminated() or (cut_after is not None and cut_after(g))):
                g.write_mask(rows[j + 1])
                ok[j] = bool(rows[j + 1].any())  # not a node into a dead end (nothing to sample after it)
        finally:
            g.rollback(walked)
    kept_t, kept_p = keep_nodes(tokens, parents, ok)
    order = [j for j in range(k) if ok[j]]
    return kept_t, kept_p, torch.from_numpy(rows[[0] + [j + 1 for j in order]])
