"""Qwen3 (dense): the Llama graph with an RMSNorm over each query and key head before RoPE.

Qwen3 has no q/k/v biases (unless `attention_bias` says so, then o_proj has one too, as in
transformers); head_dim comes from the config and may differ from hidden / heads (Qwen3-0.6B:
128 x 16 heads over a hidden size of 1,024). The q/k norms are per head_dim, so every
tensor-parallel rank holds them whole.
"""
from __future__ import annotations

import torch

from radixlm.config import ModelConfig
from radixlm.srt.distributed.context import TPContext
from radixlm.srt.layers.norm import RMSNorm
from radixlm.srt.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


def _normed(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    out = norm.forward(x)
    assert isinstance(out, torch.Tensor)
    return out


class Qwen3Attention(LlamaAttention):
    def __init__(self, config: ModelConfig, layer_id: int, dtype: torch.dtype, tp: TPContext) -> None:
        super().__init__(config, layer_id, dtype, tp)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)

    def before_rope(self, qk: torch.Tensor) -> torch.Tensor:
        t, h, d = qk.shape[0], self.num_heads, self.head_dim
        q = _normed(self.q_norm, qk[:, :h].reshape(t * h, d)).view(t, h, d)
        k = _normed(self.k_norm, qk[:, h:].reshape(t * self.num_kv_heads, d)).view(t, self.num_kv_heads, d)
        return torch.cat((q, k), dim=1)


class Qwen3DecoderLayer(LlamaDecoderLayer):
    def make_attention(self, config: ModelConfig, layer_id: int, dtype: torch.dtype, tp: TPContext) -> LlamaAttention:
        return Qwen3Attention(config, layer_id, dtype, tp)


class Qwen3ForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen3DecoderLayer
