"""Extend attention: the new tokens of each request over its cached prefix + themselves.

Used for prefill (prefix length 0), prefill after a radix-cache hit, and every chunk of
a chunked prefill. Grid (batch, head, query block): a program owns BLOCK_M consecutive
new tokens of one request and one query head, and runs one online softmax over
  A. the cached prefix, read from the pool through prefix_indices (all of it is
     visible: every prefix position precedes every new token), then
  B. the new tokens' own K/V, read straight from k/v_extend (contiguous, no index
     lookup), causally: new token i sees new tokens 0..i. Only key blocks that some
     row of the query block can see are visited.
Phase A runs first so that every row has a finite running max before any block in
which it sees nothing (avoids exp(-inf - -inf) = NaN). The kernel does not write the
pool: the caller stores the new K/V (kv_ops.store_kv) before or after, as it likes.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _online_block(q, k, v, s_mask, m_i, l_i, acc, sm_scale, logit_cap,
                  HAS_CAP: tl.constexpr, DOT_PREC: tl.constexpr):
    """One key block of the online softmax; s_mask [BLOCK_M, BLOCK_N] marks visible keys,
    and each row is assumed to have a finite running max or a visible key here."""
    s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PREC) * sm_scale
    if HAS_CAP:
        s = logit_cap * (2.0 * tl.sigmoid(2.0 * s / logit_cap) - 1.0)
    s = tl.where(s_mask, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PREC)
    return m_new, l_i, acc


@triton.jit
def _extend_kernel(Q, KExt, VExt, O, KBuf, VBuf, qo_indptr, prefix_indptr, prefix_indices,
                   sm_scale, logit_cap,
                   stride_qt, stride_qh, stride_ket, stride_keh, stride_vet, stride_veh,
                   stride_ot, stride_oh, stride_kbn, stride_kbh, stride_vbn, stride_vbh,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_CAP: tl.constexpr,
                   DOT_PREC: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    mb = tl.program_id(2)
    kvh = h // GROUP

    q_start = tl.load(qo_indptr + b)
    q_len = tl.load(qo_indptr + b + 1) - q_start
    if mb * BLOCK_M >= q_len:  # the grid is sized for the longest request
        return
    p_start = tl.load(prefix_indptr + b)
    p_len = tl.load(prefix_indptr + b + 1) - p_start

    m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = m < q_len
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q = tl.load(Q + (q_start + m)[:, None] * stride_qt + h * stride_qh + d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # A: cached prefix through the indices.
    for n0 in range(0, p_len, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < p_len
        slot = tl.load(prefix_indices + p_start + n, mask=n_mask, other=0).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(KBuf + slot[:, None] * stride_kbn + kvh * stride_kbh + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(VBuf + slot[:, None] * stride_vbn + kvh * stride_vbh + d[None, :], mask=kv_mask, other=0.0)
        m_i, l_i, acc = _online_block(q, k, v, n_mask[None, :], m_i, l_i, acc, sm_scale, logit_cap,
                                      HAS_CAP, DOT_PREC)

    # B: the new tokens, causal. Keys past the block's last row are invisible to all rows.
    hi = tl.minimum(q_len, (mb + 1) * BLOCK_M)
    for n0 in range(0, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < hi
        kv_mask = n_mask[:, None] & d_mask[None, :]
        rows = (q_start + n).to(tl.int64)
        k = tl.load(KExt + rows[:, None] * stride_ket + kvh * stride_keh + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(VExt + rows[:, None] * stride_vet + kvh * stride_veh + d[None, :], mask=kv_mask, other=0.0)
        causal = (n[None, :] <= m[:, None]) & n_mask[None, :]
        m_i, l_i, acc = _online_block(q, k, v, causal, m_i, l_i, acc, sm_scale, logit_cap,
                                      HAS_CAP, DOT_PREC)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(O + (q_start + m)[:, None] * stride_ot + h * stride_oh + d[None, :],
             out.to(O.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def extend_attention_fwd(q: torch.Tensor, k_extend: torch.Tensor, v_extend: torch.Tensor,
                         k_buffer: torch.Tensor, v_buffer: torch.Tensor, qo_indptr: torch.Tensor,
                         prefix_indptr: torch.Tensor, prefix_indices: torch.Tensor, max_extend_len: int,
                         sm_scale: float, logit_cap: float = 0.0, out: torch.Tensor | None = None,
                         block_m: int = 64, block_n: int = 64) -> torch.Tensor:
    """q [T, H, D], k/v_extend [T, Hkv, D] (new tokens of all requests, concatenated as
    qo_indptr [B + 1] says); the prefix of request b is pool slots
    prefix_indices[prefix_indptr[b] : prefix_indptr[b + 1]] -> [T, H, D].

    max_extend_len: the longest request's new-token count (sizes the grid; a host int so
    the launch needs no device sync).
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_extend.shape[1]
    assert num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
    for t in (q, k_extend, v_extend, k_buffer, v_buffer):
        assert t.stride(-1) == 1, "head_dim must be contiguous"
    if out is None:
        out = torch.empty_like(q)
    batch = qo_indptr.numel() - 1
    if num_tokens == 0 or batch == 0 or max_extend_len == 0:
        return out
    prec = "ieee" if q.dtype == torch.float32 else None  # None: the default (fp16/bf16 ignore it)
    grid = (batch, num_heads, triton.cdiv(max_extend_len, block_m))
    _extend_kernel[grid](
        q, k_extend, v_extend, out, k_buffer, v_buffer, qo_indptr, prefix_indptr, prefix_indices,
        float(sm_scale), float(logit_cap),
        q.stride(0), q.stride(1), k_extend.stride(0), k_extend.stride(1),
        v_extend.stride(0), v_extend.stride(1), out.stride(0), out.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_M=block_m, BLOCK_N=block_n, HAS_CAP=logit_cap > 0, DOT_PREC=prec, num_warps=4)
    return out
