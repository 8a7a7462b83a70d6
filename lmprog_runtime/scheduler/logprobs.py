"""Logprob bookkeeping on `Req`: prompt-side scores from the logits rows `batch.py` asked
for, and sampled-token scores from the sampler (or the verify step's rows).

Entries are (logprob, token_id); top-k and by-id lists hold one list of entries per position.
"""

from __future__ import annotations

from typing import Optional

import torch


def top_entries(lp: torch.Tensor, k: int) -> list:
    """lp: float [rows, vocab] log-probabilities → per row, the k best (logprob, id)."""
    if k <= 0:
        return [[] for _ in range(lp.shape[0])]
    vals, idx = lp.topk(min(k, lp.shape[-1]), dim=-1)
    return [list(zip(v, i)) for v, i in zip(vals.tolist(), idx.tolist())]


def entries_by_ids(lp: torch.Tensor, ids: Optional[list]) -> list:
    if not ids:
        return [[] for _ in range(lp.shape[0])]
    vals = lp[:, ids].tolist()
    return [list(zip(v, ids)) for v in vals]


def record_input_logprobs(plan, logits: torch.Tensor) -> None:
    """Score this step's prompt positions (after `commit`: kv_len counts them)."""
    for item in plan.items:
        r = item.req
        if not r.wants_input_logprobs:
            continue
        if r.logprob_start_len == 0 and not r.input_token_logprobs:
            # The first prompt token has no predecessor to score it.
            r.input_token_logprobs.append((None, r.origin_input_ids[0]))
            r.input_top_logprobs.append(None)
            r.input_token_ids_logprobs.append(None)
        if item.input_rows:
            lp = torch.log_softmax(logits[item.input_rows].float(), dim=-1)
            tokens = torch.tensor([r.origin_input_ids[j] for j in item.input_positions], device=lp.device)
            vals = lp.gather(1, tokens[:, None]).view(-1).tolist()
            r.input_token_logprobs.extend(zip(vals, tokens.tolist()))
            r.input_top_logprobs.extend(top_entries(lp, r.top_logprobs_num))
            r.input_token_ids_logprobs.extend(entries_by_ids(lp, r.token_ids_logprob))
        if r.kv_len >= r.prompt_len:
            r.input_logprobs_done = True


def record_output_logprob(r, lp_row: torch.Tensor, token: int) -> None:
    """lp_row: float [vocab] log-probabilities the token was sampled from."""
    lp_row = lp_row[None, :]
    r.output_token_logprobs.append((float(lp_row[0, token]), token))
    if r.top_logprobs_num > 0:
        r.output_top_logprobs.append(top_entries(lp_row, r.top_logprobs_num)[0])
    if r.token_ids_logprob:
        r.output_token_ids_logprobs.append(entries_by_ids(lp_row, r.token_ids_logprob)[0])
