"""ForwardBatch: what one model forward needs, built by the scheduler, read by the model.

A batch is ragged: the new tokens of every request lie flat in one tensor.
Request i owns tokens [extend_start[i], extend_start[i] + extend_lens[i]) of that
tensor; its KV for positions [0, seq_lens[i]) lives at slots
req_to_token[req_pool_indices[i], :seq_lens[i]] of the KV pool, of which the last
extend_lens[i] are being written by this forward (out_cache_loc).
A decode step is simply a batch whose extend_lens are all 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64, new tokens of all requests, flat
    positions: torch.Tensor  # [T] int64, absolute position of each new token
    out_cache_loc: torch.Tensor  # [T] int64, KV slot written for each new token
    req_pool_indices: torch.Tensor  # [B] int64, row of each request in req_to_token
    seq_lens: torch.Tensor  # [B] int64, prefix + extend length after this forward
    extend_lens: torch.Tensor  # [B] int64, new tokens per request (1 for decode)
    req_to_token: torch.Tensor  # [max_reqs, max_context] int64 (the ReqToTokenPool table)
    # Rows of the flat token axis whose logits are wanted (default: each request's last token).
    logits_indices: Optional[torch.Tensor] = None  # [L] int64
    logits_all_rows: bool = False  # logits_indices is every row in order (decode and verify steps)
    # Host copies, so backends need no device sync to loop over requests.
    seq_lens_cpu: List[int] = field(default_factory=list)
    extend_lens_cpu: List[int] = field(default_factory=list)
    # Draft trees (speculative decoding): per request None (causal) or bool [e, e] on the CPU,
    # which of its e new tokens each new token sees (all see the cached prefix); None: all causal.
    # Such a request's new tokens are at most SHORT_EXTEND and their positions are not consecutive.
    tree_masks: Optional[List[Optional[torch.Tensor]]] = None

    @property
    def batch_size(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def prefix_lens_cpu(self) -> List[int]:
        return [s - e for s, e in zip(self.seq_lens_cpu, self.extend_lens_cpu)]

    @property
    def is_decode(self) -> bool:
        return all(e == 1 for e in self.extend_lens_cpu)

    @property
    def extend_start_cpu(self) -> List[int]:
        starts, acc = [], 0
        for e in self.extend_lens_cpu:
            starts.append(acc)
            acc += e
        return starts

    def last_token_indices(self) -> torch.Tensor:
        return torch.cumsum(self.extend_lens, 0) - 1
