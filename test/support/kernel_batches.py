"""Placing a forward's new tokens into a KV pool's request-to-token table, for tests that
drive attention backends step by step without a scheduler."""
from __future__ import annotations

import torch


def place_tokens(req_to_token: torch.Tensor, free: list[int], lens, rows: list[int],
                 ext: list[int]) -> tuple[torch.Tensor, list[int]]:
    """Row r gets ext[i] new tokens after its current length lens[r], in slots popped from
    `free`; lens is updated. Returns (their slots in batch order, the prefix lengths)."""
    loc = torch.tensor([free.pop() for _ in range(sum(ext))], dtype=torch.int64)
    prefix = [lens[r] for r in rows]
    start = 0
    for r, p, e in zip(rows, prefix, ext):
        req_to_token[r, p:p + e] = loc[start:start + e]
        lens[r] = p + e
        start += e
    return loc, prefix


def random_qkv(gen: torch.Generator, n: int, heads: int, kv_heads: int, dim: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (torch.randn(n, heads, dim, generator=gen), torch.randn(n, kv_heads, dim, generator=gen),
            torch.randn(n, kv_heads, dim, generator=gen))
