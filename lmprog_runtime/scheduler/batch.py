"""StepPlan (which requests compute how many tokens this step) → ForwardBatch.

Also decides which rows of the flat token axis need logits: the last token of every
request that reaches the end of its sequence (to sample), plus the prompt positions
whose input logprobs were asked for. A request verifying a draft (speculative decoding)
computes its last token and the k drafted tokens after it: its k + 1 rows all get
logits (`verify_row` is the first), and nothing is sampled from them directly. A draft
tree (`PlannedDraft.parents`) puts node j at position `last + depth(j)` and gives the
batch a tree mask for that request (`ForwardBatch.tree_masks`: each draft sees the
prefix, the request's verified tokens, its ancestors and itself).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import List, Optional

import torch

from lmprog_runtime.model_executor.forward_batch import ForwardBatch
from lmprog_runtime.speculative.tree import depths, extend_mask


@dataclass
class PlannedDraft:
    tokens: List[int]                     # k >= 1 drafted tokens after the request's last token
    mask: Optional[torch.Tensor] = None   # bool [k + 1, vocab] (True = allowed) for constrained requests;
    #                                       row 0: after the last token, row j + 1: after draft j (its path)
    forced: bool = False                  # text the grammar forces (scheduler/jump_forward.py), not a guess
    parents: Optional[List[int]] = None   # a tree (speculative/tree.py; parents[j] < j); None: a chain
    num_forced: int = 0                   # a speculative draft's leading tokens that are forced text (a chain)

    def prefix(self, k: int) -> "PlannedDraft":
        """The first k drafts (still a tree: parents come before their children)."""
        mask = None if self.mask is None else self.mask[:k + 1]
        parents = None if self.parents is None else self.parents[:k]
        return dataclasses.replace(self, tokens=self.tokens[:k], mask=mask, parents=parents,
                                   num_forced=min(self.num_forced, k))


@dataclass
class PlannedReq:
    req: object
    num_tokens: int
    start: int  # kv_len before this step
    loc: torch.Tensor
    sample_row: int = -1  # row of the logits tensor to sample from, -1 = none this step
    input_rows: List[int] = field(default_factory=list)  # logits rows scoring prompt tokens
    input_positions: List[int] = field(default_factory=list)  # prompt index j scored by each row
    draft: Optional[PlannedDraft] = None  # its tokens are the last k of num_tokens
    verify_row: int = -1  # first of the k + 1 logits rows of a verified draft

    @property
    def num_draft(self) -> int:
        return len(self.draft.tokens) if self.draft is not None else 0


@dataclass
class StepPlan:
    items: List[PlannedReq] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.items

    def add(self, req, n: int, loc: torch.Tensor, draft=None) -> None:
        """`n` tokens of `req` from its kv_len; with a `draft`, the last len(draft.tokens) of them."""
        self.items.append(PlannedReq(req, n, req.kv_len, loc, draft=draft))

    def verified_items(self) -> List[PlannedReq]:
        return [it for it in self.items if it.verify_row >= 0]

    def sampled_reqs(self) -> list:
        """Requests sampling a token this step, in logits-row order (after `build_forward_batch`)."""
        return [it.req for it in self.items if it.sample_row >= 0]


def build_forward_batch(plan: StepPlan, runner) -> ForwardBatch:
    device = runner.device
    ids, positions, locs, logit_rows = [], [], [], []
    seq_lens, extend_lens, rows = [], [], []
    tree_masks = None  # [B] bool [e, e] or None per request, when some request verifies a tree
    offset = 0
    for item in plan.items:
        r, n, start = item.req, item.num_tokens, item.start
        fill, k = r.fill_ids, item.num_draft
        ids.extend(fill[start:start + n - k])
        if k:
            ids.extend(item.draft.tokens)
        positions.append(_positions(start, n, k, item.draft))
        if k and item.draft.parents is not None:
            tree_masks = tree_masks or [None] * len(plan.items)
            tree_masks[len(rows)] = extend_mask(item.draft.parents, n - k)
        locs.append(item.loc)
        end = start + n
        if r.wants_input_logprobs:
            # Logits at position p score prompt token p + 1.
            first = max(r.logprob_start_len - 1, start)
            for p in range(first, min(end, r.prompt_len - 1)):
                item.input_rows.append(len(logit_rows))
                item.input_positions.append(p + 1)
                logit_rows.append(offset + p - start)
        if k:
            item.verify_row = len(logit_rows)
            logit_rows.extend(range(offset + n - 1 - k, offset + n))
        elif end == r.seq_len and len(r.output_ids) < r.max_new_tokens and not r.finished:
            item.sample_row = len(logit_rows)
            logit_rows.append(offset + n - 1)
        seq_lens.append(end)
        extend_lens.append(n)
        rows.append(r.row)
        offset += n
    return ForwardBatch(
        input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
        positions=torch.cat(positions).to(device),
        out_cache_loc=torch.cat(locs).to(device),
        req_pool_indices=torch.tensor(rows, dtype=torch.int64, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
        extend_lens=torch.tensor(extend_lens, dtype=torch.int64, device=device),
        req_to_token=runner.req_to_token_pool.table,
        logits_indices=torch.tensor(logit_rows, dtype=torch.int64, device=device),
        logits_all_rows=len(logit_rows) == offset and logit_rows == list(range(offset)),
        seq_lens_cpu=seq_lens,
        extend_lens_cpu=extend_lens,
        tree_masks=tree_masks,
    )


def _positions(start: int, n: int, k: int, draft: Optional[PlannedDraft]) -> torch.Tensor:
    """[n] positions of a request's new tokens: consecutive, a tree's drafts at root + depth."""
    if not k or draft.parents is None:
        return torch.arange(start, start + n, dtype=torch.int64)
    root = start + n - k - 1
    return torch.tensor(list(range(start, root + 1)) + [root + d for d in depths(draft.parents)],
                        dtype=torch.int64)
