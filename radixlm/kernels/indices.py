"""CSR-style KV indices built from the request-to-token table (pure torch).

Both attention kernels (and FlashInfer with page size 1) address a request's KV through
`kv_indices[kv_indptr[b] : kv_indptr[b + 1]]`: the pool slots of its tokens in position
order. Building them once per forward keeps every layer's kernel free of table lookups.
"""
from __future__ import annotations

import torch


def build_indptr(lens: torch.Tensor, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """[B] lengths -> [B + 1] exclusive prefix sums (indptr[0] == 0)."""
    out = torch.zeros(lens.numel() + 1, dtype=dtype, device=lens.device)
    out[1:] = torch.cumsum(lens, 0)  # sum in the input dtype, then cast (cumsum's out= may
    # reject a dtype other than its input's on some devices)
    return out


def build_kv_indices(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                     lens: torch.Tensor, max_len: int | None = None,
                     dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Concatenation over b of req_to_token[req_pool_indices[b], :lens[b]].

    One gather of the [B, max_len] block plus a boolean-mask compaction (row-major, so
    request order and position order are kept); table entries past each length are
    stale and never leave this function.
    """
    if max_len is None:
        max_len = int(lens.max()) if lens.numel() else 0
    if max_len == 0:
        return torch.empty(0, dtype=dtype, device=req_to_token.device)
    # Columns first: the table is as wide as the context length, and a decode step's rows need
    # only their first max_len entries (32 rows of an 8k table: 2 MB copied per call otherwise).
    rows = req_to_token[:, :max_len].index_select(0, req_pool_indices.to(req_to_token.device))
    lens = lens.to(req_to_token.device)
    valid = torch.arange(max_len, device=req_to_token.device)[None, :] < lens[:, None]
    return rows[valid].to(dtype)
