"""GGUF gemma3 / gemma2 files, written with the `gguf` package's writer from a tiny Hugging Face
model the way llama.cpp's converter lays them out (its tensor names, norm weights stored as
1 + w, no q/k permutation, the keys llama.cpp writes and none it does not: the sliding pattern
and the local rope base are llama.cpp's fixed ones), load and give their safetensors twin's
logits."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from radixlm.srt.models.registry import load_model
from radixlm.srt.weights.loader import load_model_config
from test.support.gguf_twin import gguf_writer
from test.support.model_harness import ModelHarness

WINDOW = 8
SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             head_dim=32, query_pre_attn_scalar=32, max_position_embeddings=256, sliding_window=WINDOW,
             bos_token_id=1, eos_token_id=2, pad_token_id=0)
_BLOCK = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
          "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}


def _tiny(arch: str, path: str) -> str:
    from transformers import Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(61)
    if arch == "gemma3":  # llama.cpp's Gemma 3 layout: 5 sliding layers, then a global one
        cfg = Gemma3TextConfig(**SHAPE, num_hidden_layers=6, rope_scaling={"rope_type": "linear", "factor": 2.0})
        model = Gemma3ForCausalLM(cfg)
    else:
        cfg = Gemma2Config(**SHAPE, num_hidden_layers=4, attn_logit_softcapping=1.5, final_logit_softcapping=2.5,
                           initializer_range=0.1)
        model = Gemma2ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)
    model.save_pretrained(path, safe_serialization=True)
    return path


def _write_gguf(model_dir: str, out: str, arch: str) -> None:
    import gguf
    from safetensors.torch import load_file

    from radixlm.srt.weights.safetensors_loader import hf_model_config

    cfg = hf_model_config(model_dir)
    w = gguf_writer(out, arch, cfg, rope_theta=cfg.rope_theta, head_lengths=True)
    w.add_sliding_window(WINDOW)
    if cfg.rope_scaling:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(cfg.rope_scaling["factor"])
    if cfg.attn_logit_softcapping is not None:
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
    if cfg.final_logit_softcapping is not None:
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    for name, t in load_file(os.path.join(model_dir, "model.safetensors")).items():
        arr = t.float().numpy()
        if name.endswith("norm.weight"):
            arr = arr + 1  # llama.cpp's converter stores Gemma's norm scale
        if name.startswith("model.layers."):
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            gname = f"blk.{layer}.{_BLOCK[module]}.{kind}"
        else:
            gname = _GLOBAL[name]
        w.add_tensor(gname, np.ascontiguousarray(arr))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", ["gemma3", "gemma2"])
def test_gguf_matches_its_safetensors_twin(arch, tmp_path, monkeypatch):
    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(tmp_path / "cache"))
    src = _tiny(arch, str(tmp_path / "hf"))
    path = str(tmp_path / f"tiny-{arch}.gguf")
    _write_gguf(src, path, arch)
    twin, cfg = load_model_config(src), load_model_config(path)
    assert cfg.architecture == twin.architecture
    for field in ("layer_types", "sliding_window", "rope_theta", "rope_scaling", "query_pre_attn_scalar",
                  "attn_logit_softcapping", "final_logit_softcapping", "tie_word_embeddings", "head_dim"):
        assert getattr(cfg, field) == getattr(twin, field), field
    assert cfg.rope_local_base_freq == (10000.0 if arch == "gemma3" else None)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (20, 35)]
    logits = []
    for model_path, model_cfg in ((src, twin), (path, cfg)):
        h = ModelHarness(load_model(model_path, model_cfg, torch.float32, "cpu"), backend="cpu")
        logits.append(torch.cat(h.extend([h.new_request() for _ in prompts], prompts)))
    torch.testing.assert_close(logits[1], logits[0], atol=1e-5, rtol=0)
