"""GGUF files written by the `gguf` package's writer from a tiny Hugging Face model directory, as
llama.cpp's converter lays them out (float32 tensors, so the GGUF is the same model as its
safetensors twin): Llama (q/k rows permuted; a llama3 rope scaling as the `rope_freqs` tensor of
per-frequency divisors) and Phi-3 (fused attn_qkv / ffn_up; longrope as the rope_factors
tensors, the original length and the attention factor as metadata; partial rotary as the rope
dimension count). The rope parameters are computed by transformers' own rope functions."""
from __future__ import annotations

import json
import math
import os

import numpy as np

_BLOCK = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter interleaves the two rotary halves of each Llama q/k head."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_writer(out: str, arch: str, cfg, *, rope_theta: float, head_lengths: bool = False):
    """A `gguf.GGUFWriter` with the header every architecture shares, read from `cfg` (radixlm's
    ModelConfig or a transformers config: the same attribute names); `head_lengths` writes the
    key/value head size too (models whose head_dim is not hidden / heads)."""
    import gguf

    w = gguf.GGUFWriter(out, arch=arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    if head_lengths:
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    return w


def _gguf_name(name: str) -> str:
    if name.startswith("model.layers."):
        _, _, layer, rest = name.split(".", 3)
        module, kind = rest.rsplit(".", 1)
        return f"blk.{layer}.{_BLOCK[module]}.{kind}"
    return _GLOBAL[name]


def write_gguf_twin(model_dir: str, out: str, arch: str) -> str:
    """`arch`: "llama" or "phi3". Returns `out`."""
    from safetensors.torch import load_file
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    with open(os.path.join(model_dir, "config.json")) as f:
        raw = json.load(f)
    rope = dict(hf.rope_parameters)
    heads, kv_heads = hf.num_attention_heads, hf.num_key_value_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    rope_dims = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    w = gguf_writer(out, arch, hf, rope_theta=rope["rope_theta"])
    w.add_rope_dimension_count(rope_dims)
    extra: dict[str, np.ndarray] = {}
    if rope["rope_type"] == "llama3":
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        plain, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(hf)
        scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](hf)
        extra["rope_freqs.weight"] = (plain / scaled).float().numpy()
    elif rope["rope_type"] == "longrope":
        orig = rope["original_max_position_embeddings"]
        scale = hf.max_position_embeddings / orig
        w.add_rope_scaling_orig_ctx_len(orig)
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1 else 1.0)
        extra["rope_factors_long.weight"] = np.asarray(rope["long_factor"], dtype=np.float32)
        extra["rope_factors_short.weight"] = np.asarray(rope["short_factor"], dtype=np.float32)
    if arch == "phi3":
        w.add_sliding_window(raw.get("sliding_window") or 0)
    state = load_file(os.path.join(model_dir, "model.safetensors"))
    for name, t in state.items():
        data = t.float().numpy()
        if arch == "llama" and name.endswith("q_proj.weight"):
            data = llama_cpp_permute(data, heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            data = llama_cpp_permute(data, kv_heads)
        w.add_tensor(_gguf_name(name), np.ascontiguousarray(data))
    for name, arr in extra.items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
