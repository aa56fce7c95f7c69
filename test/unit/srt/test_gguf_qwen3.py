"""Qwen3 and Qwen3-MoE GGUF files (llama.cpp's qwen3 / qwen3moe), written by the gguf package's
writer from the tiny Hugging Face checkpoints as llama.cpp's converter lays them out (q/k
norms as attn_q_norm / attn_k_norm, the router as ffn_gate_inp, each layer's experts stacked
into ffn_gate_exps / ffn_up_exps / ffn_down_exps): they load into the same model as their
safetensors twin."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from radixlm.srt.models.registry import load_model
from radixlm.srt.weights.loader import iter_weights, load_model_config
from test.support.gguf_twin import gguf_writer

_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
          "mlp.gate": "ffn_gate_inp", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
_STACKED = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}


def write_qwen3_gguf(model_dir: str, out: str, arch: str, q8_experts: bool = False) -> dict[str, torch.Tensor]:
    """The checkpoint as a GGUF of `arch`; returns its tensors as they should load back (the
    stacked gate experts round-tripped through Q8_0 when `q8_experts`)."""
    import gguf
    from safetensors.torch import load_file

    from radixlm.srt.weights.safetensors_loader import hf_model_config

    cfg = hf_model_config(model_dir)
    state = {n: t.float() for n, t in load_file(os.path.join(model_dir, "model.safetensors")).items()}
    w = gguf_writer(out, arch, cfg, rope_theta=cfg.rope_theta, head_lengths=True)
    if arch == "qwen3moe":
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    expected: dict[str, torch.Tensor] = {}
    stacks: dict[tuple[int, str], list[torch.Tensor]] = {}
    for name, t in state.items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if ".experts." in name:
            _, _, layer, _, _, e, proj, _ = name.split(".")
            stacks.setdefault((int(layer), proj), []).append(t)
            assert len(stacks[(int(layer), proj)]) == int(e) + 1  # experts come in order
            continue
        if name.startswith("model.layers."):
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            gname = f"blk.{layer}.{_NAMES[module]}.{kind}"
        else:
            gname = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                     "lm_head.weight": "output.weight"}[name]
        w.add_tensor(gname, np.ascontiguousarray(t.numpy()))  # qwen3: q/k rows not permuted
        expected[name] = t
    for (layer, proj), parts in sorted(stacks.items()):
        arr = np.ascontiguousarray(torch.stack(parts).numpy())  # [experts, rows, cols]
        gname = f"blk.{layer}.{_STACKED[proj]}.weight"
        if q8_experts and proj == "gate_proj":
            q = gguf.quants.quantize(arr, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(gname, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            arr = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0).reshape(arr.shape)
        else:
            w.add_tensor(gname, arr)
        for e in range(arr.shape[0]):
            expected[f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"] = torch.from_numpy(np.array(arr[e]))
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


@pytest.fixture(scope="module")
def gguf_moe_twin(tmp_path_factory, smollm2_tokenizer) -> str:
    """A Qwen3-MoE checkpoint llama.cpp can express: every layer sparse, top-k renormalised."""
    from test.support.moe_models import qwen3_moe_dir
    return qwen3_moe_dir(tmp_path_factory.mktemp("gguf_moe_twin"), smollm2_tokenizer, seed=50, mlp_only_layers=())


def _logits(path: str, prompts: list[list[int]], make_harness) -> list[torch.Tensor]:
    cfg = load_model_config(path)
    h = make_harness(load_model(path, cfg, torch.float32, "cpu"))
    return h.extend([h.new_request() for _ in prompts], prompts)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3moe"])
def test_gguf_loads_as_its_safetensors_twin(arch, tiny_qwen3_dir, gguf_moe_twin, tmp_path, monkeypatch,
                                            make_harness):
    src = tiny_qwen3_dir if arch == "qwen3" else gguf_moe_twin
    twin = load_model_config(src)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, twin.vocab_size, (n,), generator=g).tolist() for n in (4, 19, 40)]
    # The twin first: its forward builds any native kernel not built yet into the real cache,
    # which RADIXLM_CACHE_DIR (the GGUF cache's root too) would otherwise move.
    want = _logits(src, prompts, make_harness)
    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(tmp_path / "cache"))
    path = str(tmp_path / f"tiny-{arch}.gguf")
    expected = write_qwen3_gguf(src, path, arch)
    cfg = load_model_config(path)
    for field in ("architecture", "hidden_size", "head_dim", "num_attention_heads", "num_key_value_heads",
                  "tie_word_embeddings", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                  "norm_topk_prob", "rope_theta", "rms_norm_eps", "attention_bias"):
        assert getattr(cfg, field) == getattr(twin, field), field
    got = dict(iter_weights(path, cfg))
    assert set(got) == set(expected)
    assert all(torch.equal(got[n], t) for n, t in expected.items())
    for a, b in zip(_logits(path, prompts, make_harness), want):
        assert torch.equal(a, b)  # the same weights in the same model


def test_quantized_stacked_experts_dequantize_per_expert(gguf_moe_twin, tmp_path, cache_dir):
    path = str(tmp_path / "q8.gguf")
    expected = write_qwen3_gguf(gguf_moe_twin, path, "qwen3moe", q8_experts=True)
    cfg = load_model_config(path)
    got = dict(iter_weights(path, cfg))
    name = "model.layers.2.mlp.experts.5.gate_proj.weight"
    assert got[name].shape == (48, 96) and torch.equal(got[name], expected[name])
    assert all(torch.equal(got[n], t) for n, t in expected.items())
    load_model(path, cfg, torch.float32, "cpu")  # every expert's parameters filled


def test_qwen3moe_gguf_without_expert_metadata_is_refused(gguf_moe_twin, tmp_path):
    import gguf

    path = str(tmp_path / "bad.gguf")
    w = gguf.GGUFWriter(path, arch="qwen3moe")
    for add, v in ((w.add_block_count, 1), (w.add_context_length, 64), (w.add_embedding_length, 8),
                   (w.add_feed_forward_length, 16), (w.add_head_count, 2), (w.add_layer_norm_rms_eps, 1e-6)):
        add(v)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="qwen3moe.expert_count"):
        load_model_config(path)
