"""Tiny random Qwen3, Qwen3-MoE and Mixtral checkpoints built with transformers' own config and
model classes (SmolLM2's tokenizer beside them), for the model-level and engine-level checks."""
from __future__ import annotations

import torch

TINY_VOCAB = 49152  # SmolLM2's tokenizer
# head_dim 32 over hidden 96 with 4 heads: head_dim is not hidden / heads (as in Qwen3-0.6B).
QWEN3_SHAPE = dict(hidden_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                   intermediate_size=160, vocab_size=TINY_VOCAB, max_position_embeddings=2048, bos_token_id=1,
                   eos_token_id=2, rope_theta=10000.0)


def _randomise_norms(model) -> None:
    """transformers initialises norm weights to 1: randomise them so the test sees them."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)


def _save(model, tokenizer, path) -> str:
    model.save_pretrained(str(path), safe_serialization=True)
    tokenizer.save_pretrained(str(path))
    return str(path)


def qwen3_dir(path, tokenizer, seed: int = 31, tie: bool = True) -> str:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config(**QWEN3_SHAPE, tie_word_embeddings=tie)).to(torch.float32)
    _randomise_norms(model)
    return _save(model, tokenizer, path)


def qwen3_moe_dir(path, tokenizer, seed: int = 32, norm_topk_prob: bool = True, num_experts: int = 8,
                  top_k: int = 4, mlp_only_layers: tuple[int, ...] = (1,), decoder_sparse_step: int = 1) -> str:
    """4 layers: 0, 2, 3 sparse (8 experts, top 4), 1 dense (`mlp_only_layers`)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(**dict(QWEN3_SHAPE, num_hidden_layers=4), tie_word_embeddings=False,
                         num_experts=num_experts, num_experts_per_tok=top_k, moe_intermediate_size=48,
                         norm_topk_prob=norm_topk_prob, decoder_sparse_step=decoder_sparse_step,
                         mlp_only_layers=list(mlp_only_layers))
    model = Qwen3MoeForCausalLM(cfg).to(torch.float32)
    _randomise_norms(model)
    with torch.no_grad():  # a router of zeros (transformers' init) would tie every expert
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.weight.normal_(0.0, 0.5)
    return _save(model, tokenizer, path)


def mixtral_dir(path, tokenizer, seed: int = 33) -> str:
    """2 layers of 4 experts, top 2, GQA 4/2 heads."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    cfg = MixtralConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=96, num_local_experts=4, num_experts_per_tok=2, vocab_size=TINY_VOCAB,
                        max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, rope_theta=10000.0,
                        tie_word_embeddings=False)
    model = MixtralForCausalLM(cfg).to(torch.float32)
    _randomise_norms(model)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 0.5)
    return _save(model, tokenizer, path)
