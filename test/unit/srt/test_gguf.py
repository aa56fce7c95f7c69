"""GGUF loading: tiny GGUF files written from the tiny HF models (fast), and the real
SmolLM2 GGUF against transformers' own GGUF loader (slow)."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from radixlm.srt.models.registry import load_model
from radixlm.srt.weights import loader
from radixlm.srt.weights.gguf_loader import read_gguf_metadata, unpermute_rope_rows
from radixlm.srt.weights.loader import iter_weights, load_model_config
from test.support.gguf_twin import gguf_writer


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Llama q/k rows: within each head, interleave the
    two rotary halves (HF row i -> 2i, row i + half -> 2i + 1)."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_HF_TO_GGUF = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
               "post_attention_layernorm": "ffn_norm"}


def write_gguf(model_dir: str, out: str, arch: str, tie: bool = False) -> dict[str, torch.Tensor]:
    """Convert a tiny HF checkpoint to GGUF the way llama.cpp would; returns the HF tensors
    as they should come back (after quantization round trips)."""
    import gguf
    from safetensors.torch import load_file

    from radixlm.srt.weights.safetensors_loader import hf_model_config

    cfg = hf_model_config(model_dir)
    state = load_file(os.path.join(model_dir, "model.safetensors"))
    w = gguf_writer(out, arch, cfg, rope_theta=cfg.rope_theta)
    expected: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if tie and name == "lm_head.weight":
            continue
        arr = t.float().numpy()
        if name.startswith("model.layers."):
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            gname = f"blk.{layer}.{_HF_TO_GGUF[module]}.{kind}"
        else:
            gname = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                     "lm_head.weight": "output.weight"}[name]
        data = arr
        if arch == "llama" and "q_proj" in name:
            data = llama_cpp_permute(arr, cfg.num_attention_heads)
        elif arch == "llama" and "k_proj" in name:
            data = llama_cpp_permute(arr, cfg.num_key_value_heads)
        if "mlp.down_proj" in name:  # one quantized type, to exercise dequantize + reshape
            q = gguf.quants.quantize(np.ascontiguousarray(data), gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(gname, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            arr = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0).reshape(arr.shape)
        else:
            w.add_tensor(gname, np.ascontiguousarray(data))
        expected[name] = torch.from_numpy(np.array(arr))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(d))
    return d


def test_unpermute_inverts_llama_cpp_permute():
    w = np.arange(4 * 8 * 3, dtype=np.float32).reshape(4 * 8, 3)  # 4 heads of dim 8
    back = unpermute_rope_rows(torch.from_numpy(llama_cpp_permute(w, 4)), 4)
    assert torch.equal(back, torch.from_numpy(w))


@pytest.mark.parametrize("arch,tie", [("llama", False), ("llama", True), ("qwen2", False)])
def test_tiny_gguf_roundtrip(arch, tie, tiny_llama_dir, tiny_qwen2_dir, tmp_path, cache_dir, monkeypatch):
    src = tiny_qwen2_dir if arch == "qwen2" else tiny_llama_dir
    path = str(tmp_path / f"tiny-{arch}.gguf")
    expected = write_gguf(src, path, arch, tie=tie)
    cfg = load_model_config(path)
    assert cfg.architecture == ("Qwen2ForCausalLM" if arch == "qwen2" else "LlamaForCausalLM")
    assert cfg.tie_word_embeddings == tie
    assert cfg.attention_bias == (arch == "qwen2")
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 16)
    assert cfg.eos_token_ids == (2,) and cfg.bos_token_id == 1

    got = dict(iter_weights(path, cfg))
    assert set(got) == set(expected)
    for name, t in expected.items():
        assert torch.equal(got[name], t), name
    assert list(cache_dir.rglob("model.safetensors")), "dequantized cache not written"

    # Second load comes from the cache: the GGUF dequantizer must not run again.
    def boom(*a, **k):
        raise AssertionError("GGUF dequantized twice")
    monkeypatch.setattr(loader, "iter_gguf_weights", boom)
    again = dict(iter_weights(path, cfg))
    assert all(torch.equal(again[n], t) for n, t in expected.items())
    model = load_model(path, cfg, torch.float32, "cpu")
    if tie:
        assert model.lm_head is None


def test_gguf_loads_without_writable_cache(tiny_llama_dir, tmp_path, monkeypatch):
    path = str(tmp_path / "tiny.gguf")
    write_gguf(tiny_llama_dir, path, "llama")
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("x")
    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(blocker))  # makedirs fails under a file
    cfg = load_model_config(path)
    assert len(dict(iter_weights(path, cfg))) == 2 * 9 + 3


def test_default_gguf_metadata(default_model_path):
    meta = read_gguf_metadata(default_model_path)
    cfg = load_model_config(default_model_path)
    assert meta.get("general.architecture") == "llama"
    assert cfg.architecture == "LlamaForCausalLM"
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == (30, 576, 1536)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)
    assert cfg.vocab_size == 49152 and cfg.tie_word_embeddings
    assert cfg.rope_theta == 100000.0 and cfg.rms_norm_eps == 1e-5
    assert cfg.max_position_embeddings == 8192
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == (2,)


def test_default_tokenizer_has_chatml_template(smollm2_tokenizer):
    text = smollm2_tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                                 add_generation_prompt=True)
    assert "<|im_start|>user\nhi<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")
    assert smollm2_tokenizer.convert_tokens_to_ids("<|im_end|>") == 2


@pytest.mark.slow
def test_real_gguf_matches_transformers(default_model_path, smollm2_tokenizer, make_harness):
    """Proves name mapping, dequantization and the q/k un-permutation on the real model."""
    from transformers import AutoModelForCausalLM

    cfg = load_model_config(default_model_path)
    ours = load_model(default_model_path, cfg, torch.float32, "cpu")
    ids = smollm2_tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                                tokenize=False, add_generation_prompt=True)
    ids = smollm2_tokenizer(ids, add_special_tokens=False)["input_ids"]
    h = make_harness(ours, capacity=256)
    row = h.new_request()
    got = h.extend([row], [ids])[0][-1]

    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(default_model_path),
                                              gguf_file=os.path.basename(default_model_path),
                                              dtype=torch.float32, local_files_only=True).eval()
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0, -1].float()
    assert (got - ref).abs().max() < 1e-4 * ref.abs().max()
    assert int(got.argmax()) == int(ref.argmax())
