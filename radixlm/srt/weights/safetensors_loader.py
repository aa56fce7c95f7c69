"""Hugging Face model directories: config.json -> ModelConfig, *.safetensors -> tensors."""
from __future__ import annotations

import glob
import json
import os
from typing import Any, Callable, Iterable, Iterator

import torch

from radixlm.config import ModelConfig
from radixlm.srt.distributed.layout import Shard
from radixlm.srt.layers.rope_scaling import hf_rope_scaling
from radixlm.srt.weights.gemma_config import GEMMA_ARCHS, GEMMA_MODEL_TYPES, gemma_model_config
from radixlm.srt.weights.generation_config import model_eos_ids

# Hugging Face name -> the part of the tensor to read (None: all of it); see TPLayout.shard.
ShardOf = Callable[[str], Shard | None]

# ---- Qwen3 (per-head q/k norms) and the mixture-of-experts families ----
MOE_HF_ARCHS = ("Qwen3MoeForCausalLM", "MixtralForCausalLM")
_MOE_MODEL_TYPES = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}


def moe_fields(cfg: dict, arch: str, where: str) -> dict[str, Any]:
    """The ModelConfig fields of the Qwen3 and MoE families read from config.json (empty for
    the others); ValueError for what these models do not implement."""
    if arch not in ("Qwen3ForCausalLM", *MOE_HF_ARCHS):
        return {}
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: {arch} with hidden_act {cfg.get('hidden_act')!r} is not supported (silu only)")
    if arch.startswith("Qwen3") and cfg.get("use_sliding_window"):
        raise ValueError(f"{where}: {arch} with use_sliding_window=true is not supported")
    if arch not in MOE_HF_ARCHS:
        return {}
    # Qwen3-MoE checkpoints say num_experts; Mixtral (and transformers' own save) num_local_experts.
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    top_k = int(cfg.get("num_experts_per_tok") or 0)
    if experts < 1 or not 1 <= top_k <= experts:
        raise ValueError(f"{where}: {arch} needs num_experts >= 1 and 1 <= num_experts_per_tok <= num_experts "
                         f"(got {experts} and {top_k})")
    if arch == "MixtralForCausalLM":  # every layer sparse, experts as wide as intermediate_size, top-k renormalised
        return dict(num_experts=experts, num_experts_per_tok=top_k,
                    moe_intermediate_size=int(cfg["intermediate_size"]), norm_topk_prob=True)
    return dict(num_experts=experts, num_experts_per_tok=top_k,
                moe_intermediate_size=int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                decoder_sparse_step=int(cfg.get("decoder_sparse_step") or 1),
                mlp_only_layers=tuple(int(i) for i in cfg.get("mlp_only_layers") or ()))
# ---- end Qwen3 / MoE ----


def supported_architectures() -> list[str]:
    """The architectures a config.json may name: those the model registry builds."""
    from radixlm.srt.models.registry import MODEL_ARCHS

    return MODEL_ARCHS.names()


def _read_json(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def hf_model_config(model_dir: str) -> ModelConfig:
    cfg_path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"{model_dir} has no config.json (expected a Hugging Face model directory)")
    cfg = _read_json(cfg_path)
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                   "mistral": "MistralForCausalLM", "phi3": "Phi3ForCausalLM",
                                   **_MOE_MODEL_TYPES}.get(
                                       cfg.get("model_type", ""), "")
    if (arch or GEMMA_MODEL_TYPES.get(cfg.get("model_type", ""))) in GEMMA_ARCHS:  # Gemma 2/3: own fields
        return gemma_model_config(model_dir, cfg, arch or GEMMA_MODEL_TYPES[cfg["model_type"]])
    supported = supported_architectures()
    if arch not in supported:
        raise ValueError(f"{model_dir}: architecture {arch or cfg.get('model_type')!r} is not supported "
                         f"(supported: {', '.join(supported)})")
    if cfg.get("mlp_bias"):
        raise NotImplementedError(f"{model_dir}: mlp_bias=True is not supported")

    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    rope_params = dict(cfg.get("rope_parameters") or {})
    rope_theta = float(cfg.get("rope_theta") or rope_params.get("rope_theta") or 10000.0)
    try:
        rope_scaling, partial_rotary = hf_rope_scaling(cfg)
    except ValueError as e:
        raise ValueError(f"{model_dir}: {e}") from None
    max_pos = int(cfg.get("max_position_embeddings", 2048))
    # Phi-3 family: HF masks keys beyond `sliding_window`, which radixlm does not run for it;
    # the context is limited so that every sequence fits inside the window (then full
    # attention is the same thing).
    window = cfg.get("sliding_window") if arch == "Phi3ForCausalLM" else None
    context_limit = int(window) if window and int(window) < max_pos else None

    eos = model_eos_ids(cfg.get("eos_token_id"), model_dir)

    return ModelConfig(
        architecture=arch, vocab_size=int(cfg["vocab_size"]), hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]), num_hidden_layers=int(cfg["num_hidden_layers"]),
        num_attention_heads=heads, num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=rope_theta, rope_scaling=rope_scaling,
        max_position_embeddings=max_pos, partial_rotary_factor=partial_rotary, context_limit=context_limit,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
        bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos, pad_token_id=cfg.get("pad_token_id"),
        **moe_fields(cfg, arch, model_dir))


def weight_files(model_dir: str) -> list[str]:
    """The checkpoint files of a directory: safetensors preferred, PyTorch .bin as fallback."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        shards = sorted(set(_read_json(index)["weight_map"].values()))
        return [os.path.join(model_dir, s) for s in shards]
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        files = sorted(glob.glob(os.path.join(model_dir, "pytorch_model*.bin")))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors or pytorch_model*.bin weights found")
    return files


def iter_safetensors_file(path: str, shard_of: ShardOf | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the file; with `shard_of`, only the part of each that it names (read
    through safetensors slices, so the rest is never copied out of the file)."""
    from safetensors import safe_open

    # safe_open memory-maps the file: each get_tensor is one copy straight into RAM.
    with safe_open(path, framework="pt", device="cpu") as f:
        for name in f.keys():
            shard = shard_of(name) if shard_of is not None else None
            if shard is None:
                yield name, f.get_tensor(name)
            elif shard.held:
                part = f.get_slice(name)
                index = (slice(None),) * shard.dim + (slice(shard.start, shard.stop),)
                yield name, part[index]


def iter_hf_weights(model_dir: str, shard_of: ShardOf | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    for path in weight_files(model_dir):
        if path.endswith(".safetensors"):
            yield from iter_safetensors_file(path, shard_of)
        else:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            yield from take_shards(state.items(), shard_of)
            del state


def take_shards(named: Iterable[tuple[str, torch.Tensor]], shard_of: ShardOf | None
                ) -> Iterator[tuple[str, torch.Tensor]]:
    """Cut full tensors to the parts `shard_of` names (copies, so the full ones can be freed)."""
    for name, tensor in named:
        shard = shard_of(name) if shard_of is not None else None
        if shard is None:
            yield name, tensor
        elif shard.held:
            yield name, tensor.narrow(shard.dim, shard.start, shard.stop - shard.start).clone()


def save_safetensors_atomic(tensors: dict[str, torch.Tensor], path: str, metadata: dict[str, str]) -> None:
    """Write to a temporary name then rename, so a concurrent reader never sees half a file."""
    from safetensors.torch import save_file

    tmp = f"{path}.tmp{os.getpid()}"
    try:
        save_file(tensors, tmp, metadata=metadata)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
