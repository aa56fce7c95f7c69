"""GGUF files of the Llama 3.1/3.2 (rope_freqs) and Phi-3 (fused tensors, longrope factors,
partial rotary) layouts, written by the `gguf` package's writer from tiny Hugging Face models
(test/support/gguf_twin.py): they load, carry the rope scaling into the config, and run as
their safetensors twins do: transformers' logits and greedy tokens (test/support/family_checks.py)."""
from __future__ import annotations

import math

import pytest
import torch

from radixlm.srt.weights.gguf_loader import read_gguf_metadata
from radixlm.srt.weights.loader import iter_weights, load_model_config
from test.support.family_checks import HFReference, check_greedy, check_logits
from test.support.gguf_twin import write_gguf_twin
from test.support.tiny_models import TINY_DENSE_SHAPE, randomize_norms, save_tiny_model

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64, "rope_theta": 500000.0}


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def llama31_dir(tmp_path_factory, smollm2_tokenizer) -> str:
    """A tiny Llama 3.1: llama3 rope scaling whose three bands all hold frequencies."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**TINY_DENSE_SHAPE, rope_parameters=LLAMA3)
    return save_tiny_model(LlamaForCausalLM, cfg, tmp_path_factory.mktemp("llama31"), smollm2_tokenizer, seed=41,
                           randomize=randomize_norms)


@pytest.fixture(scope="module")
def phi3_long_dir(tmp_path_factory, smollm2_tokenizer) -> str:
    from transformers import Phi3Config, Phi3ForCausalLM

    cfg = Phi3Config(**dict(TINY_DENSE_SHAPE, max_position_embeddings=192, pad_token_id=0),
                     original_max_position_embeddings=48,
                     rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                      "short_factor": [1.0, 1.1, 1.3, 1.7], "long_factor": [1.5, 3.0, 5.5, 9.0]})
    return save_tiny_model(Phi3ForCausalLM, cfg, tmp_path_factory.mktemp("phi3_gguf"), smollm2_tokenizer, seed=42,
                           randomize=randomize_norms)


def test_llama31_rope_freqs(llama31_dir, tmp_path):
    path = write_gguf_twin(llama31_dir, str(tmp_path / "llama31.gguf"), "llama")
    assert "rope_freqs.weight" in read_gguf_metadata(path).tensors
    cfg, twin = load_model_config(path), load_model_config(llama31_dir)
    assert cfg.architecture == "LlamaForCausalLM" and len(cfg.rope_scaling["freq_factors"]) == 8
    assert set(cfg.rope_scaling["freq_factors"]) > {1.0, 8.0}  # kept, slowed, and the smooth band
    from radixlm.srt.layers.rope_scaling import RopeAngles
    torch.testing.assert_close(RopeAngles(16, cfg.rope_theta, cfg.rope_scaling, 2048).inv_freq,
                               RopeAngles(16, twin.rope_theta, twin.rope_scaling, 2048).inv_freq, atol=0, rtol=1e-6)
    weights = dict(iter_weights(path, cfg))
    assert "rope_freqs.weight" not in weights and len(weights) == 2 * 9 + 3
    ref = HFReference(llama31_dir)
    check_logits(path, reference=ref)
    check_greedy(path, "plain", reference=ref)
    check_greedy(path, "chunked", reference=ref)


def test_phi3_longrope_partial_rotary(phi3_long_dir, tmp_path):
    path = write_gguf_twin(phi3_long_dir, str(tmp_path / "phi3.gguf"), "phi3")
    cfg, twin = load_model_config(path), load_model_config(phi3_long_dir)
    assert cfg.architecture == "Phi3ForCausalLM" and cfg.rotary_dim == twin.rotary_dim == 8
    scaling = dict(cfg.rope_scaling)
    assert scaling.pop("attention_factor") == pytest.approx(math.sqrt(1 + math.log(4) / math.log(48)), rel=1e-7)
    for key in ("short_factor", "long_factor"):  # stored as float32, as transformers uses them
        assert scaling.pop(key) == torch.tensor(twin.rope_scaling[key], dtype=torch.float32).tolist()
    assert scaling == {k: v for k, v in twin.rope_scaling.items() if not k.endswith("_factor")}
    assert cfg.context_len == twin.context_len == 192
    weights = dict(iter_weights(path, cfg))
    assert "model.layers.0.self_attn.qkv_proj.weight" in weights and "model.layers.0.mlp.gate_up_proj.weight" in weights
    ref = HFReference(phi3_long_dir)
    prompts = [ref.clear_prompt(n, seed=n) for n in (5, 10, 16)]
    check_logits(path, reference=ref)
    for variant in ("plain", "tp2"):  # tp 2: the dequantized fused tensors cut per rank
        check_greedy(path, variant, prompts, reference=ref)


def test_unsupported_gguf_rope_scaling_names_what_is(llama31_dir, tmp_path):
    import gguf

    path = str(tmp_path / "bad.gguf")
    w = gguf.GGUFWriter(path, arch="llama")
    for key, value in (("llama.context_length", 64), ("llama.embedding_length", 64), ("llama.block_count", 1),
                       ("llama.feed_forward_length", 128), ("llama.attention.head_count", 4)):
        w.add_uint32(key, value)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_string("llama.rope.scaling.type", "su")
    w.add_tensor("token_embd.weight", torch.zeros(10, 64).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"'su' is not supported \(supported: none, linear, yarn"):
        load_model_config(path)
