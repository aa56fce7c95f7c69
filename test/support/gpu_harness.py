"""Shared helpers for the CUDA tests and the timing script: a KV world on the GPU.

`KVWorld` plays the scheduler's part for one attention layer: it owns a KV pool, a
request-to-token table and a free list, and builds ForwardBatch objects for
extend/decode steps, so backends can be driven directly with random q/k/v.
For a whole model, model_harness.ModelHarness(..., device="cuda").
"""
from __future__ import annotations

import torch

from radixlm.srt.model_runner.attention.base import create_attention_backend
from radixlm.srt.model_runner.forward_batch import ForwardBatch, ForwardMode
from radixlm.srt.model_runner.kv_pool import MHATokenToKVPool


class KVWorld:
    def __init__(self, capacity: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 max_reqs: int, max_context: int, device: str = "cuda", poison: bool = True) -> None:
        self.pool = MHATokenToKVPool(capacity, 1, num_kv_heads, head_dim, dtype, device)
        if poison:  # unowned slots hold NaN: a backend reading them fails loudly
            self.pool.k_buffer[0][1:] = float("nan")
            self.pool.v_buffer[0][1:] = float("nan")
        self.device = device
        self.req_to_token = torch.zeros(max_reqs, max_context, dtype=torch.int64, device=device)
        self.free = torch.randperm(capacity, device=device) + 1  # scattered slots
        self.used = 0
        self.lens = [0] * max_reqs

    def step(self, mode: ForwardMode, rows: list[int], ext: list[int]) -> ForwardBatch:
        """Allocate slots for `ext[i]` new tokens of request rows[i] and describe the step."""
        n = sum(ext)
        loc = self.free[self.used:self.used + n]
        self.used += n
        prefix = [self.lens[r] for r in rows]
        start = 0
        for r, p, e in zip(rows, prefix, ext):
            self.req_to_token[r, p:p + e] = loc[start:start + e]
            self.lens[r] = p + e
            start += e
        return ForwardBatch.build(mode, [0] * n, loc, rows, prefix, ext, self.req_to_token, self.device)

    def fill_prefix(self, rows: list[int], lens: list[int], num_kv_heads: int, head_dim: int,
                    gen: torch.Generator | None = None) -> None:
        """Give each request `lens[i]` cached tokens of random KV without running attention."""
        fb = self.step(ForwardMode.EXTEND, rows, lens)
        k = torch.randn(fb.num_tokens, num_kv_heads, head_dim, device=self.device, generator=gen)
        v = torch.randn(fb.num_tokens, num_kv_heads, head_dim, device=self.device, generator=gen)
        self.pool.set_kv(0, fb.out_cache_loc, k, v)


def make_backend(name: str, world: KVWorld, num_heads: int, num_kv_heads: int, head_dim: int):
    return create_attention_backend(name, world.pool, num_heads, num_kv_heads, head_dim)
