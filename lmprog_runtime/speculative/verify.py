"""Verification: which drafted tokens the target accepts, from the logits of the last
verified token and of every drafted position (rows 0..k of one request).

Row i scores the token after draft[:i]. The rows go through the sampler's own pipeline
(`Sampler.scaled_logits`: penalties, min_new_tokens, mask, logit bias, temperature), each
row seeing the output as it stands there (`_row_views`: output_ids + draft[:i]), so a row
is exactly what a plain decode step would have sampled from.

- Greedy: accept the longest prefix of the draft equal to the rows' argmax, then the
  argmax of the next row (the bonus token): the tokens a plain greedy decode produces.
- Sampling: rejection sampling for a deterministic draft. With p_i the target's
  probabilities at row i (top-k / top-p / min-p applied as the plain sampler applies
  them), accept draft[i] with probability p_i(draft[i]); on the first rejection sample
  from p_i with draft[i] removed and renormalized, and stop; if every draft is accepted,
  sample the bonus from p_k. Each emitted token is then distributed exactly as p_i:
  P(x) = p(d)·[x = d] + (1 - p(d))·p(x)[x ≠ d] / (1 - p(d)) = p(x).
The draws use the request's own generator when it has a sampling_seed, else the sampler's.

Trees (`parents`, speculative/tree.py): row 0 scores the root's children, row j + 1 the
children of node j. Greedy walks down from the root, following the child whose token is
the row's argmax, and ends with the argmax of the last node's row (the bonus). Sampling
is the multi-candidate rejection of SpecInfer for deterministic drafts: at a node with
residual r = p (its row's probabilities), try its children in order; child c is accepted
with probability r(t_c) (then go down to c), else r(t_c) = 0 and r is renormalized; when
every child is rejected the emitted token is drawn from r. By the chain argument applied
child after child, P(emit x) = p(x) at every node (siblings carry distinct tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch

from lmprog_runtime.speculative.tree import children, path_to


@dataclass
class Verified:
    tokens: List[int]                      # accepted drafts + the bonus token
    accepted: int                          # how many of `tokens` were drafts
    logprobs: Optional[torch.Tensor]       # float [len(tokens), vocab] rows, when the request asked
    path: Optional[List[int]] = None       # a tree: draft indices of the accepted tokens, root down


def verify_rows(sampler, r, rows: torch.Tensor, draft: List[int], mask: Optional[torch.Tensor],
                parents: Optional[List[int]] = None) -> Verified:
    """rows: float [k + 1, V] logits (read only: the sampler's pipeline edits a copy); mask:
    bool [k + 1, vocab] or None; parents: the draft's tree (None: a chain)."""
    reqs = _row_views(r, draft, parents)
    best = None if r.return_logprob else sampler.plain_argmax(rows, list(range(len(reqs))), reqs, mask)
    if best is not None:  # greedy rows nothing but a mask edits: their argmax read in place (Sampler.plain_argmax)
        if parents is None:
            return Verified(*_accept_best(best, draft), None)
        tokens, path = _accept_tree_best(best, draft, parents)
        return Verified(tokens, len(path), None, path)
    scaled = sampler.scaled_logits(rows.clone(), reqs, mask)
    path = None
    if parents is None:
        if r.sampling.is_greedy:
            tokens, accepted = _accept_greedy(scaled, draft)
        else:
            tokens, accepted = _accept_sampled(_probs(sampler, scaled, reqs), draft, _gen(sampler, r))
        lp_rows = list(range(len(tokens)))
    else:
        if r.sampling.is_greedy:
            tokens, path = accept_tree_greedy(scaled, draft, parents)
        else:
            tokens, path = accept_tree_sampled(_probs(sampler, scaled, reqs), draft, parents, _gen(sampler, r))
        accepted = len(path)
        lp_rows = [0] + [j + 1 for j in path]
    lp = torch.log_softmax(scaled[lp_rows], dim=-1) if r.return_logprob else None
    return Verified(tokens, accepted, lp, path)


def _probs(sampler, scaled: torch.Tensor, reqs) -> torch.Tensor:
    return sampler.truncated_probs(scaled, reqs).cpu()


def _gen(sampler, r) -> torch.Generator:
    return r.generator if r.generator is not None else sampler.generator


class _RowView:
    """What the sampler reads of a request (`sampling`, `output_ids`), as it stands at one
    verify row: row i follows output_ids + draft[:i], so frequency / presence / repetition
    penalties count those tokens and min_new_tokens sees that length, as a plain step would."""

    __slots__ = ("sampling", "output_ids")

    def __init__(self, sampling, output_ids):
        self.sampling, self.output_ids = sampling, output_ids


def _row_views(r, draft: List[int], parents: Optional[List[int]] = None) -> list:
    """[k + 1] requests for the sampler's pipeline; `r` itself when no row would differ.
    In a tree, row j + 1 follows the path to node j."""
    sp = r.sampling
    penalized = sp.frequency_penalty != 0 or sp.presence_penalty != 0 or sp.repetition_penalty != 1.0
    if not penalized and len(r.output_ids) >= sp.min_new_tokens:  # the sampler's own test
        return [r] * (len(draft) + 1)
    if parents is None:
        return [_RowView(sp, r.output_ids + draft[:i]) for i in range(len(draft) + 1)]
    return [_RowView(sp, r.output_ids)] + [
        _RowView(sp, r.output_ids + [draft[i] for i in path_to(parents, j)]) for j in range(len(draft))]


def _accept_greedy(scaled: torch.Tensor, draft: List[int]):
    return _accept_best(torch.argmax(scaled, dim=-1).tolist(), draft)


def _accept_best(best: List[int], draft: List[int]):
    """best: the rows' argmax [k + 1] -> (accepted drafts + the bonus token, how many drafts)."""
    a = 0
    while a < len(draft) and draft[a] == best[a]:
        a += 1
    return draft[:a] + [best[a]], a


def _accept_sampled(probs: torch.Tensor, draft: List[int], gen: torch.Generator):
    """probs: float [k + 1, V] on the CPU."""
    for i, x in enumerate(draft):
        p = probs[i]
        if float(torch.rand((), generator=gen)) < float(p[x]):
            continue
        residual = p.clone()
        residual[x] = 0.0
        total = float(residual.sum())
        if total <= 0.0:  # all the mass is on x (p(x) rounded below 1): x is the only choice
            continue
        tok = int(torch.multinomial(residual / total, 1, generator=gen))
        return draft[:i] + [tok], i
    return draft + [int(torch.multinomial(probs[len(draft)], 1, generator=gen))], len(draft)


def accept_tree_greedy(scaled: torch.Tensor, draft: List[int], parents: List[int]):
    """scaled [k + 1, V] → (accepted tokens + bonus, accepted node indices)."""
    return _accept_tree_best(torch.argmax(scaled, dim=-1).tolist(), draft, parents)


def _accept_tree_best(best: List[int], draft: List[int], parents: List[int]):
    """best: the rows' argmax [k + 1] → accept_tree_greedy's answer."""
    kids = children(parents)
    path: List[int] = []
    row = 0
    while True:
        nxt = next((c for c in kids[row] if draft[c] == best[row]), None)
        if nxt is None:
            return [draft[j] for j in path] + [best[row]], path
        path.append(nxt)
        row = nxt + 1


def accept_tree_sampled(probs: torch.Tensor, draft: List[int], parents: List[int], gen: torch.Generator):
    """probs: float [k + 1, V] on the CPU → (accepted tokens + the emitted one, accepted nodes)."""
    kids = children(parents)
    path: List[int] = []
    row = 0
    while True:
        residual = probs[row]
        down = None
        for c in kids[row]:
            x = draft[c]
            if float(torch.rand((), generator=gen)) < float(residual[x]):
                down = c
                break
            residual = residual.clone()
            residual[x] = 0.0
            total = float(residual.sum())
            if total <= 0.0:  # all the mass was on x (rounded below 1): x is the only choice
                down = c
                break
            residual = residual / total
        if down is None:
            tok = int(torch.multinomial(residual, 1, generator=gen))
            return [draft[j] for j in path] + [tok], path
        path.append(down)
        row = down + 1
