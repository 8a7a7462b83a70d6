"""The Llama family (Llama 2/3, SmolLM2, Qwen2 with q/k/v bias), one ragged batch per forward.

Read top to bottom: rotary table -> RMSNorm -> attention -> MLP -> decoder layer -> model.
Every forward sees all new tokens of all requests flat on one axis `T`; attention over
each request's cached prefix is the attention backend's job (`forward_batch` tells it
where). Projections are fused (q|k|v in one matmul, gate|up in one) so a decode step
is a handful of matmuls per layer.

Numerics follow transformers' `LlamaForCausalLM` exactly: RMSNorm in float32, rotary
cos/sin computed in float32 then cast to the activation dtype, rotate-half layout.
"""

from __future__ import annotations

import math
from typing import Iterable, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from lmprog_runtime.model_executor import decode_ops, fused_ops, llama_layer
from lmprog_runtime.model_executor.forward_batch import ForwardBatch
from lmprog_runtime.model_executor.loader import ModelConfig
from lmprog_runtime.model_executor.quant import QuantLinear, decode_rows


# -- rotary position embedding -------------------------------------------------------------------
def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] float32, with llama3 / linear scaling as in transformers."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3)")


def rope_cos_sin_table(config: ModelConfig, max_positions: int) -> torch.Tensor:
    """[max_positions, 2, head_dim] float32: cos of every position (halves repeated), and its sin
    with the first half negated (the rotate-half sign folded in, see `apply_rope`)."""
    inv_freq = rope_inv_freq(config)  # [D/2]
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32, device="cpu"), inv_freq)  # [P, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [P, D]
    sin = freqs.sin()
    return torch.stack([emb.cos(), torch.cat([-sin, sin], dim=-1)], dim=1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    # x [T, heads, D]; cos, signed_sin [T, 1, D]. Rotate-half is cat(-x2, x1) * sin; with the
    # sign in the table it is cat(x2, x1) * signed_sin: the same products bit for bit (a sign
    # flip is exact), one op fewer per layer.
    half = x.shape[-1] // 2
    swapped = torch.cat([x[..., half:], x[..., :half]], dim=-1)
    return x * cos + swapped * signed_sin


def fused_decode_ok(x: torch.Tensor, fb: Optional[ForwardBatch], attn_backend) -> bool:
    """Whether the layers may run rope + the KV write as one C call (decode_ops.rope_kv): float32
    activations and a float32 or bfloat16 KV pool on the CPU, int64 positions and slots. The C
    op checks each position and slot itself (an IndexError, as indexing the table would raise)."""
    pool = getattr(attn_backend, "kv_pool", None)
    if fb is None or pool is None or pool.k is None or not decode_ops.usable(x) or fb.positions.numel() == 0:
        return False
    if fb.positions.dtype != torch.int64 or fb.out_cache_loc.dtype != torch.int64:
        return False
    return pool.k.dtype in decode_ops.KV_DTYPES and pool.k.is_contiguous() and pool.v.is_contiguous()


# -- layers ----------------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        """Normalize `x`, or with `residual` the sum `x + residual`, returning (normed, sum)."""
        if fused_ops.usable(x, self.weight):  # float32 on the CPU: one C call (fused_ops.py)
            normed, total = fused_ops.add_rms_norm(x, residual, self.weight, self.eps)
            return normed if residual is None else (normed, total)
        if residual is not None:
            x = x + residual
            return self._norm(x), x
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # one fused op; measured bit-identical to the two-step form below in float32
            return F.rms_norm(x, (x.shape[-1],), self.weight, eps=self.eps)
        # normalize in float32 like transformers, scale in the activation dtype
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
        return self.weight * normed


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)

    def forward(self, x, cos, sin, forward_batch: ForwardBatch, attn_backend, rope_table=None) -> torch.Tensor:
        # x [T, hidden]; rope_table [P, 2, D] float32 when the fused CPU path runs (see `fused_decode_ok`)
        T, H, KV, D = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)  # [T, (H + 2 KV) * D]
        if rope_table is not None:  # float32 on the CPU, as `fused_decode_ok` checked for x
            # one C call: rope of q and k, k and v written into this layer's KV slots
            pool = attn_backend.kv_pool
            if pool.load_gate is not None:  # what set_kv does: HiCache's layer-wise load-backs
                pool.load_gate.wait(self.layer_id)  # in flight must have copied this layer first
            q = decode_ops.rope_kv(qkv.contiguous(), H, KV, rope_table, forward_batch.positions, forward_batch.out_cache_loc,
                                   pool.k[self.layer_id], pool.v[self.layer_id])  # [T, H, D]
            out = attn_backend.forward(q, None, None, self.layer_id, forward_batch, save_kv_cache=False)
            return self.o_proj(out)
        # q and k rotated in one pass (elementwise, so bit-identical to rotating them apart)
        qk = apply_rope(qkv[:, :self.q_size + self.kv_size].view(T, H + KV, D), cos, sin)  # [T, H+KV, D]
        q, k = qk[:, :H].contiguous(), qk[:, H:]  # [T, H, D], [T, KV, D]
        v = qkv[:, self.q_size + self.kv_size:].view(T, KV, D)  # [T, KV, D]
        out = attn_backend.forward(q, k, v, self.layer_id, forward_batch)  # [T, H * D]
        return self.o_proj(out)  # [T, hidden]


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2I]
        if _c_quantized(self.gate_up_proj) and fused_ops.act_usable(gate_up):
            # quantized on lmprog's C kernels: fused_ops.c's silu * up, the one llama_layer.c's
            # fused step calls (so both paths agree bit for bit); float32/dense models keep torch's
            return self.down_proj(fused_ops.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)  # [T, I] each
        return self.down_proj(F.silu(gate) * up)  # [T, hidden]


def _c_quantized(linear: nn.Module) -> bool:
    return isinstance(linear, QuantLinear) and linear._c_kernel is not None


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_id)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, residual, cos, sin, forward_batch, attn_backend, rope_table=None):
        """(x, residual) -> (mlp out, residual): the layer's input is x + residual (x alone for the
        first layer, residual None), so each residual add is fused into the next norm."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual=residual)  # x + residual, normalized and not
        attn = self.self_attn(h, cos, sin, forward_batch, attn_backend, rope_table)
        h, residual = self.post_attention_layernorm(attn, residual=residual)
        return self.mlp(h), residual


# -- the model -------------------------------------------------------------------------------------------
class LlamaForCausalLM(nn.Module):
    """`forward(forward_batch) -> logits [L, vocab] float32` for rows `forward_batch.logits_indices`.

    The runner sets `attn_backend` (an `AttentionBackend`) before the first forward.
    """

    def __init__(self, config: ModelConfig, max_positions: Optional[int] = None):
        super().__init__()
        self.config = config
        weight = torch.empty(config.vocab_size, config.hidden_size)
        # on the meta device (a model built for loading) the init is skipped: meta normal_() goes
        # through torch's reference ops, which import torch._dynamo (~1.3 s of a warm start)
        self.embed_tokens = (nn.Embedding(config.vocab_size, config.hidden_size, _weight=weight) if weight.is_meta
                             else nn.Embedding(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # [P, 2, D] float32 on the CPU: a plain attribute, not a buffer, so `.to(dtype)` never
        # rounds it; it follows the activations' device on first use.
        self.rope_table = rope_cos_sin_table(config, max_positions or config.context_length)
        self.attn_backend = None
        self.quant_head = None  # a QuantLinear for the logits when the weights are quantized

    def forward(self, forward_batch: ForwardBatch) -> torch.Tensor:
        x = self.embed_tokens(forward_batch.input_ids)  # [T, hidden]
        if self.rope_table.device != x.device:
            self.rope_table = self.rope_table.to(x.device)
        rope_table, cos, sin = self.rope_table, None, None
        if not fused_decode_ok(x, forward_batch, self.attn_backend):
            rope_table = None
            cos_sin = self.rope_table[forward_batch.positions].to(x.dtype)  # [T, 2, D]
            cos, sin = cos_sin[:, 0:1], cos_sin[:, 1:2]  # [T, 1, D]
        rows, T, B = forward_batch.logits_indices, x.shape[0], forward_batch.seq_lens.shape[0]
        # every row wants logits: decode and verify steps (the scheduler says so for its index list)
        all_rows = forward_batch.logits_all_rows if rows is not None else B == T
        final = (self.norm, self.quant_head) if all_rows and self.quant_head is not None else None
        if all_rows and T > B and self.quant_head is not None:
            # a verify step: each row computes as the decode it replaces would (quant.decode_rows)
            with decode_rows(B):
                return self._layers_and_logits(x, cos, sin, forward_batch, rope_table, final, rows, all_rows)
        return self._layers_and_logits(x, cos, sin, forward_batch, rope_table, final, rows, all_rows)

    def _layers_and_logits(self, x, cos, sin, forward_batch, rope_table, final, rows, all_rows):
        x, residual, logits = self.run_layers(x, cos, sin, forward_batch, self.attn_backend, rope_table, final)
        if logits is not None:  # the whole step in C made them (llama_layer.FusedLayers.run)
            return logits
        if not all_rows:
            rows = forward_batch.last_token_indices() if rows is None else rows
            x, residual = x[rows], residual[rows]
        x, _ = self.norm(x, residual=residual)  # [L, hidden]
        if self.quant_head is not None:
            return self.quant_head(x).float()  # [L, vocab]
        head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(x, head).float()  # [L, vocab]

    def run_layers(self, x, cos, sin, forward_batch, attn_backend, rope_table=None, final=None):
        """Every decoder layer: (last layer's mlp out, residual, None) [T, hidden] each; the
        hidden state is their sum (left to the final norm, which adds them). A quantized decode
        step runs as two C calls per layer where llama_layer.plan allows (same bits, less
        Python); `final` = (norm, head) where every row wants logits: a step run as one C call
        then returns (None, None, logits) instead (the same bits as norm and head here)."""
        if rope_table is not None:  # fused_decode_ok held: float32 on the CPU (rope_kv checks the indices)
            fused = llama_layer.plan(self, x.shape[0])
            if fused is not None:
                return fused.run(x, forward_batch, attn_backend, rope_table, final)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin, forward_batch, attn_backend, rope_table)
        return x, residual, None

    # -- weights: HF names in, fused parameters out --
    _FUSED = {  # HF suffix -> (our parameter suffix, shard index)
        "self_attn.q_proj": ("self_attn.qkv_proj", 0),
        "self_attn.k_proj": ("self_attn.qkv_proj", 1),
        "self_attn.v_proj": ("self_attn.qkv_proj", 2),
        "mlp.gate_proj": ("mlp.gate_up_proj", 0),
        "mlp.up_proj": ("mlp.gate_up_proj", 1),
    }

    def _shard_rows(self, fused: str, shard: int) -> Tuple[int, int]:
        c = self.config
        if ".qkv_proj." in fused:
            q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
            return [(0, q), (q, kv), (q + kv, kv)][shard]
        return shard * c.intermediate_size, c.intermediate_size

    def hf_shard_names(self, param: str) -> Tuple[str, ...]:
        """The HF weight names stacked (in row order) into our parameter `param`."""
        for hf_part, (ours, _) in self._FUSED.items():
            if f".{ours}." in f".{param}":
                shards = [h for h, (o, _) in self._FUSED.items() if o == ours]
                return tuple("model." + param.replace(ours, h) for h in shards)
        return ("model." + param,)

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into our (partly fused) parameters; every parameter must be set."""
        params = dict(self.named_parameters())
        missing = {n for n in params if not n.endswith(("qkv_proj.weight", "qkv_proj.bias", "gate_up_proj.weight"))}
        missing |= {f"{n}#{i}" for n in params if n.endswith(("qkv_proj.weight", "qkv_proj.bias")) for i in range(3)}
        missing |= {f"{n}#{i}" for n in params if n.endswith("gate_up_proj.weight") for i in range(2)}
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if (name == "lm_head.weight" and self.lm_head is None) or "rotary_emb" in name:
                continue  # tied head = the embedding; rotary tables are recomputed
            target, shard = name, None
            for hf_part, (ours, index) in self._FUSED.items():
                if f".{hf_part}." in f".{name}":
                    target, shard = name.replace(hf_part, ours), index
                    break
            if target not in params:
                raise ValueError(f"unexpected weight {hf_name!r} for {self.config.architecture}")
            param = params[target]
            dest = param.data if shard is None else param.data.narrow(0, *self._shard_rows(target, shard))
            if dest.shape != tensor.shape:
                raise ValueError(f"weight {hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
            dest.copy_(tensor)
            missing.discard(target if shard is None else f"{target}#{shard}")
        if missing:
            raise ValueError(f"checkpoint lacks weights for: {', '.join(sorted(missing)[:8])}")


EntryClass = LlamaForCausalLM
