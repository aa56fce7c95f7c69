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
    request, read through `req_to_token`. A sliding-window layer (`window` = W) sees only
    (p - W, p], whatever else its request's row holds (a cached prefix, earlier chunks); with
    `softcap` = c each scaled score s becomes c * tanh(s / c) before the softmax (Gemma 2).
    Backends that cannot do either say so (`supports_window`, `supports_softcap`) and refuse.
    """

    supports_window = True
    supports_softcap = True

    def __init__(self, kv_pool, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.kv_pool = kv_pool
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        """Called once per forward, before the first layer (index building goes here)."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                fb: ForwardBatch, scale: float, window: int | None = None,
                softcap: float | None = None) -> torch.Tensor:
        """q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim] -> [T, num_heads, head_dim]."""

    def forward_rows(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                     fb: ForwardBatch, scale: float, rows: torch.Tensor, window: int | None = None,
                     softcap: float | None = None) -> torch.Tensor:
        """forward()[rows]: every token's K/V is stored, only the `rows` (int64) are needed
        out. A backend may attend for those rows alone."""
        return self.forward(q, k, v, layer_id, fb, scale, window, softcap).index_select(0, rows)


def check_model_attention(backend: AttentionBackend, name: str, model_config) -> None:
    """A clear error at start-up, not at the first forward, when the model has sliding-window
    layers or soft-capped scores and the backend cannot attend that way."""
    if model_config.sliding_window is not None and model_config.layer_types and not backend.supports_window:
        raise ValueError(f"attention backend {name!r} does not implement sliding-window attention "
                         f"({model_config.architecture}); use --attention-backend cpu or torch_native")
    if model_config.attn_logit_softcapping is not None and not backend.supports_softcap:
        raise ValueError(f"attention backend {name!r} does not implement attention logit soft-capping "
                         f"({model_config.architecture}); use --attention-backend cpu or torch_native")


def create_attention_backend(name: str, kv_pool, num_heads: int, num_kv_heads: int,
                             head_dim: int) -> AttentionBackend:
    return ATTENTION_BACKENDS.get(name)(kv_pool, num_heads, num_kv_heads, head_dim)
