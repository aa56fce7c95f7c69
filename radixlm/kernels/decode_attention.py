"""Decode attention (one query token per request) over the token-granular KV pool.

Split-KV, two stages:
  1. grid (batch, kv_head, split): each program takes one KV head and *all* G query
     heads that share it (GQA grouping: K/V are loaded once for G queries, and the G
     rows form the M side of tl.dot), walks its split of the request's KV through
     kv_indices with an online softmax, and writes a normalised partial output plus its
     log-sum-exp.
  2. grid (batch, head): merges the splits: out = sum_s exp(lse_s - M) o_s / sum_s exp(lse_s - M).
Splitting matters when batch * kv_heads is too small to fill the GPU (long contexts at
small batch); `choose_num_kv_splits` trades that against the merge cost.

Masked loads never touch unowned pool slots (the pool is torch.empty: stale slots may
hold NaN), and an empty split writes lse = -inf and o = 0 so it carries no weight.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _decode_split_kernel(Q, K, V, kv_indptr, kv_indices, MidO, MidLse,
                         sm_scale, logit_cap, num_splits,
                         stride_qb, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
                         stride_mb, stride_mh, stride_ms, stride_lb, stride_lh,
                         GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, HAS_CAP: tl.constexpr,
                         DOT_PREC: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    g = tl.arange(0, BLOCK_H)  # BLOCK_H >= 16 pads the group for tl.dot; padded rows masked
    h = kvh * GROUP + g
    h_mask = g < GROUP
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM

    kv_start = tl.load(kv_indptr + b)
    kv_len = tl.load(kv_indptr + b + 1) - kv_start
    split_len = tl.cdiv(kv_len, num_splits)
    lo = split * split_len
    hi = tl.minimum(lo + split_len, kv_len)

    q = tl.load(Q + b * stride_qb + h[:, None] * stride_qh + d[None, :],
                mask=h_mask[:, None] & d_mask[None, :], other=0.0)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)

    for n0 in range(lo, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < hi
        slot = tl.load(kv_indices + kv_start + n, mask=n_mask, other=0).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(K + slot[:, None] * stride_kn + kvh * stride_kh + d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PREC) * sm_scale
        if HAS_CAP:
            # tanh via sigmoid: portable across Triton versions and the interpreter.
            s = logit_cap * (2.0 * tl.sigmoid(2.0 * s / logit_cap) - 1.0)
        s = tl.where(n_mask[None, :], s, float("-inf"))
        # Every block has >= 1 valid key (n0 < hi), so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + slot[:, None] * stride_vn + kvh * stride_vh + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PREC)
        m_i = m_new

    nonempty = l_i > 0
    o = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    lse = tl.where(nonempty, m_i + tl.log(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    mid = MidO + b * stride_mb + h[:, None] * stride_mh + split * stride_ms + d[None, :]
    tl.store(mid, o, mask=h_mask[:, None] & d_mask[None, :])
    tl.store(MidLse + b * stride_lb + h * stride_lh + split, lse, mask=h_mask)


@triton.jit
def _decode_merge_kernel(MidO, MidLse, O, num_splits,
                         stride_mb, stride_mh, stride_ms, stride_lb, stride_lh, stride_ob, stride_oh,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    s_mask = s < num_splits
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    base = b * stride_mb + h * stride_mh
    lse = tl.load(MidLse + b * stride_lb + h * stride_lh + s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # all splits empty (zero-length KV): output 0
    w = tl.exp(lse - m)
    o = tl.load(MidO + base + s[:, None] * stride_ms + d[None, :],
                mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    den = tl.sum(w, 0)
    out = tl.sum(w[:, None] * o, 0) / tl.where(den > 0, den, 1.0)
    tl.store(O + b * stride_ob + h * stride_oh + d, out.to(O.dtype.element_ty), mask=d_mask)


def choose_num_kv_splits(batch: int, num_kv_heads: int, max_len: int, block_n: int = 64,
                         max_splits: int = 16, target_programs: int = 256) -> int:
    """Enough splits for ~target_programs stage-1 programs, but never a split shorter
    than one block (it would only add merge work). target_programs ~ 2x the SM count."""
    by_len = max(1, triton.cdiv(max_len, block_n))
    by_occupancy = max(1, triton.cdiv(target_programs, max(1, batch * num_kv_heads)))
    return max(1, min(max_splits, by_len, by_occupancy))


def decode_attention_fwd(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                         kv_indptr: torch.Tensor, kv_indices: torch.Tensor, sm_scale: float,
                         logit_cap: float = 0.0, num_kv_splits: int = 1, out: torch.Tensor | None = None,
                         block_n: int = 64) -> torch.Tensor:
    """q [B, H, D]; k/v_buffer [S, Hkv, D]; kv_indptr [B + 1]; kv_indices [nnz] -> [B, H, D].

    Request b attends over pool slots kv_indices[kv_indptr[b] : kv_indptr[b + 1]]
    (its whole KV, the current token included). num_kv_splits: see choose_num_kv_splits.
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    assert num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
    assert q.stride(-1) == 1 and k_buffer.stride(-1) == 1 and v_buffer.stride(-1) == 1
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    if batch == 0:
        return out
    num_kv_splits = max(1, int(num_kv_splits))
    mid_o = torch.empty((batch, num_heads, num_kv_splits, head_dim), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty((batch, num_heads, num_kv_splits), dtype=torch.float32, device=q.device)
    block_d = triton.next_power_of_2(head_dim)
    # IEEE fp32 dots for fp32 inputs: tf32 (the GPU default) would perturb fp32 logits
    # enough to flip greedy tokens against the torch backend.
    prec = "ieee" if q.dtype == torch.float32 else None  # None: the default (fp16/bf16 ignore it)
    _decode_split_kernel[(batch, num_kv_heads, num_kv_splits)](
        q, k_buffer, v_buffer, kv_indptr, kv_indices, mid_o, mid_lse,
        float(sm_scale), float(logit_cap), num_kv_splits,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n,
        HAS_CAP=logit_cap > 0, DOT_PREC=prec, num_warps=4)
    _decode_merge_kernel[(batch, num_heads)](
        mid_o, mid_lse, out, num_kv_splits,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=triton.next_power_of_2(num_kv_splits), num_warps=4)
    return out
