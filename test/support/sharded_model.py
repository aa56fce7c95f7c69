"""A small model config shaped for uneven tensor-parallel splits, and random Hugging Face
weights for it (test/unit/distributed)."""
from __future__ import annotations

import torch

from radixlm.config import ModelConfig

VOCAB = 1003  # odd: the vocabulary shards are uneven


def tiny_config(heads: int, kv: int, *, arch: str = "LlamaForCausalLM", tied: bool = True,
            bias: bool = False) -> ModelConfig:
    return ModelConfig(architecture=arch, vocab_size=VOCAB, hidden_size=heads * 8, intermediate_size=70,
                       num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=kv, head_dim=8,
                       tie_word_embeddings=tied, attention_bias=bias, max_position_embeddings=256)


def random_weights(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d

    def r(*shape: int, scale: float = 0.2) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    out = {"model.embed_tokens.weight": r(cfg.vocab_size, h, scale=1.0), "model.norm.weight": 1 + r(h)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = r(cfg.vocab_size, h)
    for n in range(cfg.num_hidden_layers):
        p = f"model.layers.{n}."
        out |= {p + "self_attn.q_proj.weight": r(q, h), p + "self_attn.k_proj.weight": r(kv, h),
                p + "self_attn.v_proj.weight": r(kv, h), p + "self_attn.o_proj.weight": r(h, q),
                p + "mlp.gate_proj.weight": r(i, h), p + "mlp.up_proj.weight": r(i, h),
                p + "mlp.down_proj.weight": r(h, i), p + "input_layernorm.weight": 1 + r(h),
                p + "post_attention_layernorm.weight": 1 + r(h)}
        if cfg.attention_bias:
            out |= {p + "self_attn.q_proj.bias": r(q), p + "self_attn.k_proj.bias": r(kv),
                    p + "self_attn.v_proj.bias": r(kv)}
            if cfg.architecture != "Qwen2ForCausalLM":
                out[p + "self_attn.o_proj.bias"] = r(h)
    return out
