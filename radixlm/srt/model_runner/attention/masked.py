"""Attention with a sliding window and/or soft-capped scores, in torch, per request.

The layers of Gemma 2/3 that torch_native runs, and those the cpu backend cannot give its
native kernels (soft-capped scores; a windowed extend too large for the decode kernel's rows).
Each request's new tokens (a decode token, an extend chunk) attend over its own keys read
through `req_to_token`; only the keys some query can see are gathered: with a window W, the
token at position p sees positions p - W < j <= p, so a chunk starting at position s reads
[max(0, s - W + 1), s + len). What the prefix cache holds beyond that is never read.

Scores are computed as Hugging Face's eager attention does them: (q k^T) * scale, then
cap * tanh(s / cap), then the mask, then a float32 softmax rounded to the compute dtype.
"""
from __future__ import annotations

from typing import Callable

import torch

from radixlm.srt.model_runner.forward_batch import ForwardBatch, ForwardMode

# (slots int64 [n], 0 for K / 1 for V) -> [n, Hkv, D] in the compute dtype
Gather = Callable[[torch.Tensor, int], torch.Tensor]


def request_spans(fb: ForwardBatch) -> list[tuple[int, int, int]]:
    """(request slot row, tokens already in the pool before these, new tokens) per request."""
    if fb.mode == ForwardMode.DECODE:
        return [(row, n - 1, 1) for row, n in zip(fb.req_pool_indices_cpu, fb.seq_lens_cpu)]
    return list(zip(fb.req_pool_indices_cpu, fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu))


def first_visible(position: int, window: int | None) -> int:
    """The first key position the query at `position` attends to."""
    return 0 if window is None else max(0, position - window + 1)


def attend_masked(q: torch.Tensor, fb: ForwardBatch, gather: Gather, group: int, scale: float,
                  window: int | None, softcap: float | None) -> torch.Tensor:
    """q [T, H, D] (the batch's new tokens, request by request) -> [T, H, D]; every new token's
    K/V must already be in the pool."""
    out = torch.empty_like(q)
    device = q.device
    start = 0
    for row, prefix, ext in request_spans(fb):
        if ext == 0:
            continue
        lo, hi = first_visible(prefix, window), prefix + ext
        slots = fb.req_to_token[row, lo:hi].to(device)
        k = gather(slots, 0).to(q.dtype).transpose(0, 1)  # [Hkv, n, D]
        v = gather(slots, 1).to(q.dtype).transpose(0, 1)
        if group > 1:
            k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        qh = q[start:start + ext].transpose(0, 1)  # [H, ext, D]
        scores = torch.matmul(qh, k.transpose(1, 2)) * scale  # [H, ext, n]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(prefix, hi, device=device)[:, None]
        k_pos = torch.arange(lo, hi, device=device)[None, :]
        visible = k_pos <= q_pos
        if window is not None:
            visible &= k_pos > q_pos - window
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out[start:start + ext] = torch.matmul(probs, v).transpose(0, 1)
        start += ext
    return out


def window_rows(fb: ForwardBatch, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode-style CSR rows of a sliding layer: new token t of the batch (its request's row r,
    position p) is one row over req_to_token[r, max(0, p - window + 1) : p + 1], in position order.
    Returns (indptr [T + 1], slot indices), int64 on the host; any forward mode (a decode step's
    tokens are their requests' single new tokens)."""
    table = fb.req_to_token
    rows = torch.repeat_interleave(fb.req_pool_indices.cpu(), fb.extend_seq_lens.cpu(), output_size=fb.num_tokens)
    ends = fb.positions.cpu() + 1
    keep = ends.clamp(max=window)
    indptr = torch.zeros(keep.numel() + 1, dtype=torch.int64)
    torch.cumsum(keep, 0, out=indptr[1:])
    total = int(indptr[-1])
    # Element e of row t: the table's flat entry rows[t] * stride + ends[t] - keep[t] + (e - indptr[t]).
    shift = torch.repeat_interleave(rows * table.stride(0) + ends - keep - indptr[:-1], keep, output_size=total)
    offsets = torch.arange(total, dtype=torch.int64) + shift
    return indptr, table.reshape(-1).index_select(0, offsets)
