"""Pure-torch twins of the Triton kernels: the definition each kernel is tested against.

Written for clarity (per-request loops, float32 math), not speed. Every function reads
only the pool slots named by its indices, as the kernels do, so never-written slots
(which may hold NaN, see MHATokenToKVPool) cannot leak into results.

Layouts shared with the kernels:
  q            [T, H, D]    query head h uses KV head h // (H // Hkv)
  k/v_buffer   [S, Hkv, D]  the KV pool of one layer, indexed by slot
  *_indptr     [B + 1]      request b owns entries indptr[b] : indptr[b + 1]
  kv_indices   [nnz]        pool slots of those entries, in position order
"""
from __future__ import annotations

import torch


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float, logit_cap: float,
            causal_offset: int | None) -> torch.Tensor:
    """q [L, H, D], k/v [S, Hkv, D] -> [L, H, D] in float32.

    causal_offset: query i sits at position causal_offset + i and sees keys 0..that
    position; None means every query sees every key.
    """
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    s = torch.einsum("lhd,shd->hls", q.float(), k) * sm_scale
    if logit_cap > 0:
        s = logit_cap * torch.tanh(s / logit_cap)
    if causal_offset is not None:
        q_pos = torch.arange(q.shape[0], device=q.device)[:, None] + causal_offset
        s = s.masked_fill(torch.arange(k.shape[0], device=q.device)[None, :] > q_pos, float("-inf"))
    if k.shape[0] == 0:  # nothing to attend to: defined as zeros, like the kernels
        return torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    return torch.einsum("hls,shd->lhd", s.softmax(-1), v)


def decode_attention_ref(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                         kv_indptr: torch.Tensor, kv_indices: torch.Tensor, sm_scale: float,
                         logit_cap: float = 0.0) -> torch.Tensor:
    """q [B, H, D]: one query per request over all of its KV -> [B, H, D] in q.dtype."""
    out = torch.empty_like(q)
    ptr = kv_indptr.tolist()
    for b in range(q.shape[0]):
        idx = kv_indices[ptr[b]:ptr[b + 1]].long()
        out[b] = _attend(q[b:b + 1], k_buffer[idx], v_buffer[idx], sm_scale, logit_cap, None)[0]
    return out


def extend_attention_ref(q: torch.Tensor, k_extend: torch.Tensor, v_extend: torch.Tensor,
                         k_buffer: torch.Tensor, v_buffer: torch.Tensor, qo_indptr: torch.Tensor,
                         prefix_indptr: torch.Tensor, prefix_indices: torch.Tensor, sm_scale: float,
                         logit_cap: float = 0.0) -> torch.Tensor:
    """q/k/v_extend [T, *, D]: the new tokens of each request (qo_indptr) attend over the
    request's cached prefix (read from the pool through prefix_indices) and causally over
    the new tokens themselves (read from k/v_extend) -> [T, H, D] in q.dtype."""
    out = torch.empty_like(q)
    qo, pre = qo_indptr.tolist(), prefix_indptr.tolist()
    for b in range(len(qo) - 1):
        if qo[b + 1] == qo[b]:
            continue
        idx = prefix_indices[pre[b]:pre[b + 1]].long()
        ks = torch.cat([k_buffer[idx].to(k_extend.dtype), k_extend[qo[b]:qo[b + 1]]])
        vs = torch.cat([v_buffer[idx].to(v_extend.dtype), v_extend[qo[b]:qo[b + 1]]])
        out[qo[b]:qo[b + 1]] = _attend(q[qo[b]:qo[b + 1]], ks, vs, sm_scale, logit_cap, idx.numel())
    return out


def store_kv_ref(k_buffer: torch.Tensor, v_buffer: torch.Tensor, loc: torch.Tensor,
                 k: torch.Tensor, v: torch.Tensor) -> None:
    """k_buffer[loc[i]] = k[i] (cast to the pool dtype); same for v."""
    k_buffer[loc.long()] = k.to(k_buffer.dtype)
    v_buffer[loc.long()] = v.to(v_buffer.dtype)


def gather_rows_ref(bufs: list[torch.Tensor], slots: torch.Tensor) -> torch.Tensor:
    """[len(bufs), n, *row]: the rows `slots` of every buffer (a page-copy staging block)."""
    return torch.stack([b.index_select(0, slots.to(b.device).long()) for b in bufs])


def scatter_rows_ref(bufs: list[torch.Tensor], slots: torch.Tensor, src: torch.Tensor) -> None:
    """bufs[i][slots] = src[i] for every buffer (inverse of gather_rows_ref)."""
    for b, rows in zip(bufs, src):
        b.index_copy_(0, slots.to(b.device).long(), rows.to(device=b.device, dtype=b.dtype))
