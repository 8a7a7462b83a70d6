"""Triton kernels for paged attention over the token-slot KV pool.

Layout (see `cache/kv_pool.py`): `k_cache`, `v_cache` are one layer's [slots, kv_heads, D];
the KV of position p of the request in table row r lives at slot `req_to_token[r, p]`.
The new tokens' K/V are already in the pool when these kernels run, so both the cached
prefix and the new part are read through the table (any page size works: the kernels
gather slot by slot).

- `extend_attention`: prefill/append. Program (request, head, block of BLOCK_M new
  tokens); loop 1 over the prefix (no mask), loop 2 over the new tokens up to the end of
  this query block (causal). Online softmax in base 2, fp32 accumulators.
- `decode_attention`: one new token per request, split-K. Stage 1, program (request,
  kv head, split): all query heads of one KV head (GQA group, padded to BLOCK_H >= 16 so
  `tl.dot` has its minimum tile) attend over the split's slice of the context and write
  a partial output plus its log-sum-exp; stage 2, program (request, head): merges the
  splits by their log-sum-exp.

Scores are computed in base 2 (`qk * scale * log2 e`, `exp2`), lse is base 2 too.
Interpreter note: Triton's CPU interpreter computes `tl.dot` on bfloat16 wrongly (it
treats the raw bits as integers), so under TRITON_INTERPRET bf16 operands are upcast to
fp32 (`UPCAST`); on a GPU bf16/fp16 go to the tensor cores as they are. fp32 KV uses
IEEE fp32 dots (no TF32) so the fp32 path matches the reference closely.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from lmprog_runtime.config import TRITON_INTERPRET as INTERPRET

LOG2E = 1.4426950408889634


@triton.jit
def _mm(a, b, UPCAST: tl.constexpr):
    """a @ b with fp32 accumulation; UPCAST: both operands in fp32, IEEE precision."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a.to(b.dtype), b)


@triton.jit
def _load_kv_tile(K, V, table, pos, mask_n, kv_head, offs_d, mask_d,
                  stride_kt, stride_kh, stride_vt, stride_vh):
    """K (transposed, [D, N]) and V ([N, D]) of KV positions `pos` of one request, through
    its slot table; masked positions read slot 0 and are zeroed."""
    slot = tl.load(table + pos, mask=mask_n, other=0)
    k = tl.load(K + slot[None, :] * stride_kt + kv_head * stride_kh + offs_d[:, None],
                mask=mask_n[None, :] & mask_d[:, None], other=0.0)
    v = tl.load(V + slot[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :],
                mask=mask_n[:, None] & mask_d[None, :], other=0.0)
    return k, v


@triton.jit
def _softmax_step(qk, v, m_i, l_i, acc, UPCAST: tl.constexpr):
    """One online-softmax update with scores qk [M, N] (base 2, -inf = masked) and v [N, D]."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _mm(p, v, UPCAST)
    return m_new, l_i, acc


@triton.jit
def _extend_kernel(
    Q, O, K, V, Req_to_token, Req_pool_idx, Seq_lens, Extend_lens, Extend_start, Tree_mask, Tree_off,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_req, sm_scale_log2,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, HAS_TREE: tl.constexpr,
):
    req, head, mblk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    ext_len = tl.load(Extend_lens + req)
    if mblk * BLOCK_M < ext_len:
        kv_head = head // GROUP
        seq_len = tl.load(Seq_lens + req)
        prefix = seq_len - ext_len
        q_start = tl.load(Extend_start + req)
        table = Req_to_token + tl.load(Req_pool_idx + req) * stride_req

        offs_m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)  # new-token index within the request
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        mask_m, mask_d = offs_m < ext_len, offs_d < HEAD_DIM
        q = tl.load(Q + (q_start + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                    mask=mask_m[:, None] & mask_d[None, :], other=0.0)  # [M, D]
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

        # cached prefix: every new token sees all of it
        for start in range(0, prefix, BLOCK_N):
            pos = start + offs_n
            mask_n = pos < prefix
            k, v = _load_kv_tile(K, V, table, pos, mask_n, kv_head, offs_d, mask_d,
                                 stride_kt, stride_kh, stride_vt, stride_vh)  # [D, N], [N, D]
            qk = _mm(q, k, UPCAST) * sm_scale_log2
            qk = tl.where(mask_n[None, :], qk, float("-inf"))
            m_i, l_i, acc = _softmax_step(qk, v, m_i, l_i, acc, UPCAST)

        # new tokens: causal, only up to the last query of this block
        end = prefix + tl.minimum(ext_len, (mblk + 1) * BLOCK_M)
        for start in range(prefix, end, BLOCK_N):
            pos = start + offs_n
            mask_n = pos < end
            slot = tl.load(table + pos, mask=mask_n, other=0)
            k = tl.load(K + slot[None, :] * stride_kt + kv_head * stride_kh + offs_d[:, None],
                        mask=mask_n[None, :] & mask_d[:, None], other=0.0)
            v = tl.load(V + slot[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :],
                        mask=mask_n[:, None] & mask_d[None, :], other=0.0)
            qk = _mm(q, k, UPCAST) * sm_scale_log2
            visible = mask_n[None, :] & ((prefix + offs_m)[:, None] >= pos[None, :])
            if HAS_TREE:  # a draft tree: row-major [ext_len, ext_len] int8 at Tree_off (-1: causal)
                tree_off = tl.load(Tree_off + req)
                if tree_off >= 0:
                    in_tree = visible & mask_m[:, None]
                    seen = tl.load(Tree_mask + tree_off + offs_m[:, None] * ext_len + (pos - prefix)[None, :],
                                   mask=in_tree, other=0)
                    visible = in_tree & (seen != 0)
            qk = tl.where(visible, qk, float("-inf"))
            m_i, l_i, acc = _softmax_step(qk, v, m_i, l_i, acc, UPCAST)

        out = acc / l_i[:, None]
        tl.store(O + (q_start + offs_m)[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
                 out.to(O.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


@triton.jit
def _decode_partial_kernel(
    Q, K, V, Req_to_token, Req_pool_idx, Seq_lens, Mid_o, Mid_lse,
    stride_qb, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_req,
    stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh,
    sm_scale_log2, num_splits,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr,
):
    req, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq_len = tl.load(Seq_lens + req)
    split_len = tl.cdiv(seq_len, num_splits)
    lo = split * split_len
    hi = tl.minimum(lo + split_len, seq_len)
    if lo < hi:
        table = Req_to_token + tl.load(Req_pool_idx + req) * stride_req
        offs_g = tl.arange(0, BLOCK_H)
        heads = kv_head * GROUP + offs_g
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        mask_h, mask_d = offs_g < GROUP, offs_d < HEAD_DIM
        q = tl.load(Q + req * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=mask_h[:, None] & mask_d[None, :], other=0.0)  # [H, D]
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        for start in range(lo, hi, BLOCK_N):
            pos = start + offs_n
            mask_n = pos < hi
            k, v = _load_kv_tile(K, V, table, pos, mask_n, kv_head, offs_d, mask_d,
                                 stride_kt, stride_kh, stride_vt, stride_vh)  # [D, N], [N, D]
            qk = _mm(q, k, UPCAST) * sm_scale_log2
            qk = tl.where(mask_n[None, :], qk, float("-inf"))
            m_i, l_i, acc = _softmax_step(qk, v, m_i, l_i, acc, UPCAST)
        mid = Mid_o + req * stride_mob + heads[:, None] * stride_moh + split * stride_mos + offs_d[None, :]
        tl.store(mid, acc / l_i[:, None], mask=mask_h[:, None] & mask_d[None, :])
        tl.store(Mid_lse + req * stride_mlb + heads * stride_mlh + split, m_i + tl.log2(l_i), mask=mask_h)


@triton.jit
def _decode_reduce_kernel(
    Mid_o, Mid_lse, O, Seq_lens,
    stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh, stride_ob, stride_oh,
    num_splits, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):
    req, head = tl.program_id(0), tl.program_id(1)
    seq_len = tl.load(Seq_lens + req)
    split_len = tl.cdiv(seq_len, num_splits)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    m = float("-inf")
    den = 0.0
    acc = tl.zeros([BLOCK_D], tl.float32)
    # split 0 is never empty (seq_len >= 1), so m is finite after it and no exp2(-inf - -inf)
    for s in range(0, num_splits):
        used = s * split_len < seq_len
        # an empty split wrote nothing: its scratch is garbage, selected away (not multiplied by 0)
        lse = tl.load(Mid_lse + req * stride_mlb + head * stride_mlh + s)
        lse = tl.where(used, lse, float("-inf"))
        o = tl.load(Mid_o + req * stride_mob + head * stride_moh + s * stride_mos + offs_d, mask=mask_d, other=0.0)
        o = tl.where(used, o, 0.0)
        m_new = tl.maximum(m, lse)
        alpha = tl.exp2(m - m_new)
        w = tl.exp2(lse - m_new)
        acc = acc * alpha + w * o
        den = den * alpha + w
        m = m_new
    tl.store(O + req * stride_ob + head * stride_oh + offs_d, (acc / den).to(O.dtype.element_ty), mask=mask_d)


# -- launchers ------------------------------------------------------------------------------
def _upcast(kv_dtype: torch.dtype) -> bool:
    return kv_dtype == torch.float32 or (INTERPRET and kv_dtype == torch.bfloat16)


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def extend_attention(q, o, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, extend_lens,
                     extend_start, max_extend_len: int, scaling: float,
                     block_m: int = 64, block_n: int = 64, num_warps: int = 4, num_stages: int = 1,
                     tree_mask=None, tree_off=None) -> None:
    """o[t] = causal paged attention of new token t; q/o [T, H, D], k/v cache [slots, KV, D].

    Request i's new tokens are rows [extend_start[i], extend_start[i] + extend_lens[i]) of q,
    at KV indices seq_lens[i] - extend_lens[i] ... seq_lens[i] - 1. With `tree_off` [B] int64,
    request i with tree_off[i] >= 0 attends its new tokens through the int8 [e, e] row-major
    mask at tree_mask[tree_off[i]:] (nonzero = visible; a draft tree) instead of causally.
    """
    T, H, D = q.shape
    KV = k_cache.shape[1]
    assert q.stride(-1) == 1 and o.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    grid = (seq_lens.shape[0], H, triton.cdiv(max_extend_len, block_m))
    has_tree = tree_off is not None
    if not has_tree:  # never read
        tree_mask = tree_off = extend_lens
    _extend_kernel[grid](
        q, o, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, extend_lens, extend_start,
        tree_mask, tree_off,
        q.stride(0), q.stride(1), o.stride(0), o.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), req_to_token.stride(0), scaling * LOG2E,
        GROUP=H // KV, HEAD_DIM=D, BLOCK_D=_block_d(D), BLOCK_M=block_m, BLOCK_N=block_n,
        UPCAST=_upcast(k_cache.dtype), HAS_TREE=has_tree, num_warps=num_warps, num_stages=num_stages,
    )


def decode_attention(q, o, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, mid_o, mid_lse,
                     num_splits: int, scaling: float, block_n: int = 64, num_warps: int = 4) -> None:
    """o[b] = paged attention of request b's single new token over its seq_lens[b] slots.

    q/o [B, H, D]; mid_o [B, H, >=num_splits, D] and mid_lse [B, H, >=num_splits] float32 scratch.
    """
    B, H, D = q.shape
    KV = k_cache.shape[1]
    group = H // KV
    assert q.stride(-1) == 1 and o.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert mid_o.shape[2] >= num_splits and mid_lse.shape[2] >= num_splits, (mid_o.shape, num_splits)
    _decode_partial_kernel[(B, KV, num_splits)](
        q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, mid_o, mid_lse,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        req_to_token.stride(0), mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1), scaling * LOG2E, num_splits,
        GROUP=group, HEAD_DIM=D, BLOCK_D=_block_d(D), BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_N=block_n, UPCAST=_upcast(k_cache.dtype), num_warps=num_warps, num_stages=2,
    )
    _decode_reduce_kernel[(B, H)](
        mid_o, mid_lse, o, seq_lens, mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1), o.stride(0), o.stride(1), num_splits,
        HEAD_DIM=D, BLOCK_D=_block_d(D), num_warps=4,
    )
