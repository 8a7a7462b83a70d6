"""Embeddings from the served (generative) model: the final-norm hidden states of a prompt,
pooled (last token or mean over tokens) and L2-normalized, as SGLang does for a
generative model served for embedding.

Computed by a dense causal forward over each prompt alone, with the model's own layers and
weights but no KV cache (`DenseCausalAttention` stands in for the paged backend): an
embedding request takes no KV slots and leaves the radix cache untouched.
"""

from __future__ import annotations

from typing import List

import torch
import torch.nn.functional as F


class DenseCausalAttention:
    """The attention-backend contract (`forward(q, k, v, layer_id, fb)`) for one sequence
    held entirely in the call: causal SDPA, nothing written anywhere."""

    def forward(self, q, k, v, layer_id: int, fb) -> torch.Tensor:
        # q [T, H, D]; k, v [T, KV, D] -> [T, H * D]
        T, H, D = q.shape
        group = H // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [T, H, D]
        # 4-d, for torch's CPU flash-attention kernel (3-d inputs take the much slower math path)
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                             is_causal=True)[0]  # [H, T, D]
        return out.transpose(0, 1).reshape(T, H * D)


@torch.inference_mode()
def final_hidden_states(model, input_ids: List[int], device) -> torch.Tensor:
    """[T, hidden] float32: the model's normalized last-layer states of `input_ids`."""
    ids = torch.tensor(input_ids, dtype=torch.int64, device=device)
    x = model.embed_tokens(ids)  # [T, hidden]
    table = model.rope_table.to(device)
    cos_sin = table[torch.arange(len(input_ids), device=device)].to(x.dtype)  # [T, 2, D]
    cos, sin = cos_sin[:, 0:1], cos_sin[:, 1:2]
    attention = DenseCausalAttention()
    x, residual, _ = model.run_layers(x, cos, sin, None, attention)
    return model.norm(x, residual=residual)[0].float()


def pooled_embedding(model, input_ids: List[int], device, pooling: str) -> List[float]:
    """One normalized embedding [hidden] of `input_ids` as a list of floats."""
    states = final_hidden_states(model, input_ids, device)  # [T, hidden]
    vec = states[-1] if pooling == "last" else states.mean(dim=0)
    return F.normalize(vec, dim=0).cpu().tolist()
