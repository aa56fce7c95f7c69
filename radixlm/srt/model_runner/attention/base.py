"""The attention backend contract and its registry."""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from radixlm.registry import Registry
from radixlm.srt.model_runner.forward_batch import ForwardBatch

ATTENTION_BACKENDS: Registry[type["AttentionBackend"]] = Registry("attention backend")
# Each backend registers itself in its own module, imported on first use.
for _name in ("cpu", "torch_native", "triton", "flashinfer"):
    ATTENTION_BACKENDS.register_lazy(_name, f"radixlm.srt.model_runner.attention.{_name}")


class AttentionBackend(ABC):
    """Stores the new tokens' K/V in the KV pool and attends over prefix + new tokens.

    Queries attend causally: the token at position p sees KV positions [0, p] of its own
    request, read through `req_to_token`.
    """

    def __init__(self, kv_pool, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.kv_pool = kv_pool
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        """Called once per forward, before the first layer (index building goes here)."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                fb: ForwardBatch, scale: float) -> torch.Tensor:
        """q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim] -> [T, num_heads, head_dim]."""

    def forward_rows(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                     fb: ForwardBatch, scale: float, rows: torch.Tensor) -> torch.Tensor:
        """forward()[rows]: every token's K/V is stored, only the `rows` (int64) are needed
        out. A backend may attend for those rows alone."""
        return self.forward(q, k, v, layer_id, fb, scale).index_select(0, rows)


def create_attention_backend(name: str, kv_pool, num_heads: int, num_kv_heads: int,
                             head_dim: int) -> AttentionBackend:
    return ATTENTION_BACKENDS.get(name)(kv_pool, num_heads, num_kv_heads, head_dim)
