"""Phi3ForCausalLM against transformers' Phi3 (test/support/family_checks.py): fused qkv_proj /
gate_up_proj checkpoints, longrope with short and long factors, partial rotary; every engine
path, tensor parallelism included (the fused tensors are cut per rank)."""
from __future__ import annotations

import json
import os

import pytest
import torch

from radixlm.kernels.cpu import ops as cpu_ops
from radixlm.srt.models.llama import LlamaForCausalLM
from radixlm.srt.weights.loader import load_model_config
from test.support.family_checks import (VARIANTS, HFReference, check_decode_logits, check_greedy, check_logits,
                                        load_radixlm)
from test.support.model_harness import ModelHarness
from test.support.tiny_models import TINY_DENSE_SHAPE, randomize_norms, save_tiny_model

ROTARY = 8  # of head_dim 16: partial_rotary_factor 0.5
SHORT = [1.0 + 0.2 * i for i in range(ROTARY // 2)]
LONG = [1.5 + 1.3 * i for i in range(ROTARY // 2)]


def _phi3_config(**kw):
    from transformers import Phi3Config

    return Phi3Config(**dict(TINY_DENSE_SHAPE, pad_token_id=0, **kw))


@pytest.fixture(scope="module")
def phi3_dir(tmp_path_factory, smollm2_tokenizer) -> str:
    """Phi-3-mini's shape at a tiny size: whole-head rope, no scaling."""
    from transformers import Phi3ForCausalLM

    cfg = _phi3_config(rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return save_tiny_model(Phi3ForCausalLM, cfg, tmp_path_factory.mktemp("phi3"), smollm2_tokenizer, seed=31,
                           randomize=randomize_norms)


@pytest.fixture(scope="module")
def phi3_long_dir(tmp_path_factory, smollm2_tokenizer) -> str:
    """Phi-3-128k's scaling at a tiny size (original length 48 of 192: attention factor
    sqrt(1 + ln 4 / ln 48)), over half of each head (Phi-4-mini's partial rotary)."""
    from transformers import Phi3ForCausalLM

    cfg = _phi3_config(max_position_embeddings=192, original_max_position_embeddings=48,
                       rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": SHORT,
                                        "long_factor": LONG, "partial_rotary_factor": ROTARY / 16})
    return save_tiny_model(Phi3ForCausalLM, cfg, tmp_path_factory.mktemp("phi3_long"), smollm2_tokenizer, seed=32,
                           randomize=randomize_norms)


@pytest.fixture(scope="module")
def phi3_ref(phi3_dir) -> HFReference:
    return HFReference(phi3_dir)


def test_config(phi3_dir, phi3_long_dir):
    with open(os.path.join(phi3_dir, "config.json")) as f:
        assert json.load(f)["architectures"] == ["Phi3ForCausalLM"]
    cfg = load_model_config(phi3_dir)
    assert cfg.architecture == "Phi3ForCausalLM" and cfg.rope_scaling is None and cfg.rotary_dim == 16
    long = load_model_config(phi3_long_dir)
    assert long.rotary_dim == ROTARY and long.partial_rotary_factor == 0.5
    assert long.rope_scaling == {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG,
                                 "original_max_position_embeddings": 48}
    assert long.context_len == 192


def test_logits(phi3_dir, phi3_ref):
    check_logits(phi3_dir, reference=phi3_ref)


@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy(phi3_dir, phi3_ref, variant):
    check_greedy(phi3_dir, variant, reference=phi3_ref)


def test_longrope_partial_rotary(phi3_long_dir):
    """Prompts of 5, 19 and 40 tokens and 32-token continuations that end at the original
    length (48): logits, every decode step's logits and the greedy tokens are transformers'
    generate's, on one rank and at tp 2. (Past that length transformers' Phi-3 recomputes the
    whole sequence with the long factors, which radixlm does not: rope_scaling.py.)"""
    ref = HFReference(phi3_long_dir)
    prompts = [ref.clear_prompt(n, seed=n) for n in (5, 10, 16)]
    check_logits(phi3_long_dir, reference=ref)
    check_decode_logits(phi3_long_dir, prompts, reference=ref)
    for variant in ("plain", "chunked", "tp2"):
        check_greedy(phi3_long_dir, variant, prompts, reference=ref, chunk=4)


@pytest.mark.skipif(not cpu_ops.available(), reason="native CPU kernels could not be built")
def test_fused_decode_only_where_its_graph_holds(phi3_dir, phi3_long_dir, tiny_llama_dir):
    """The native decode layers run Phi-3 with whole-head rope; not partial rotary (the kernel
    rotates whole heads), and not a model class that merely subclasses Llama's."""

    def fused_table_built(model) -> bool:
        h = ModelHarness(model, backend="cpu")
        row = h.new_request()
        h.extend([row], [[5, 6, 7]])
        h.decode([row], [8])
        return model._fused_decode._table is not None

    assert fused_table_built(load_radixlm(phi3_dir))
    assert not fused_table_built(load_radixlm(phi3_long_dir))

    class OtherFamily(LlamaForCausalLM):
        pass

    llama = load_radixlm(tiny_llama_dir)
    assert fused_table_built(llama)
    other = load_radixlm(tiny_llama_dir)
    other.__class__ = OtherFamily
    assert not fused_table_built(other)


def test_a_sliding_window_shorter_than_the_context_limits_it(tmp_path, phi3_dir):
    """Phi-3-mini-4k masks keys beyond a 2,047-token window, which radixlm does not run for
    Phi-3: its context is limited to the window, inside which full attention is the same."""
    with open(os.path.join(phi3_dir, "config.json")) as f:
        cfg = json.load(f)
    d = tmp_path / "windowed"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(dict(cfg, sliding_window=100)))
    assert load_model_config(str(d)).context_len == 100
    (d / "config.json").write_text(json.dumps(dict(cfg, sliding_window=262144)))
    assert load_model_config(str(d)).context_len == cfg["max_position_embeddings"]


def test_split_fused_cuts_rows_in_checkpoint_order(phi3_dir):
    from radixlm.srt.models.phi3 import Phi3ForCausalLM

    cfg = load_model_config(phi3_dir)
    qkv = torch.arange((64 + 2 * 32) * 3, dtype=torch.float32).view(128, 3)
    out = dict(Phi3ForCausalLM.split_fused([("model.layers.0.self_attn.qkv_proj.weight", qkv)], cfg))
    assert torch.equal(out["model.layers.0.self_attn.q_proj.weight"], qkv[:64])
    assert torch.equal(out["model.layers.0.self_attn.k_proj.weight"], qkv[64:96])
    assert torch.equal(out["model.layers.0.self_attn.v_proj.weight"], qkv[96:])
    with pytest.raises(ValueError, match="rows"):
        list(Phi3ForCausalLM.split_fused([("model.layers.0.mlp.gate_up_proj.weight", qkv)], cfg))


def test_fused_updates_reach_each_ranks_shard():
    """update_weights_from_tensor at tp 2 with Phi-3's fused names: each rank keeps its heads'
    rows of q, k and v (its rows of gate and up), as when loading."""
    from dataclasses import replace

    from radixlm.srt.distributed.context import TPContext
    from radixlm.srt.distributed.layout import TPLayout
    from radixlm.srt.model_runner.weight_updater import WeightUpdater
    from radixlm.srt.models.phi3 import Phi3ForCausalLM
    from radixlm.srt.models.registry import build_model
    from radixlm.srt.weights.safetensors_loader import take_shards
    from test.support.sharded_model import random_weights, tiny_config

    cfg = replace(tiny_config(9, 3, tied=False), architecture="Phi3ForCausalLM")
    split = random_weights(cfg, 1)
    fused = {"model.layers.1.self_attn.qkv_proj.weight": torch.cat([split[f"model.layers.1.self_attn.{p}_proj.weight"]
                                                                    for p in "qkv"]),
             "model.layers.1.mlp.gate_up_proj.weight": torch.cat([split["model.layers.1.mlp.gate_proj.weight"],
                                                                 split["model.layers.1.mlp.up_proj.weight"]])}
    for rank in range(2):
        layout = TPLayout.build(cfg, 2, rank)
        model = build_model(cfg, torch.float32, "cpu", TPContext(layout, None))
        model.load_weights(take_shards(Phi3ForCausalLM.split_fused(
            {n: torch.zeros_like(t) for n, t in split.items()}.items(), cfg), layout.shard))
        WeightUpdater(model).update(fused.items())
        want = build_model(cfg, torch.float32, "cpu", TPContext(layout, None))
        want.load_weights(take_shards(split.items(), layout.shard))
        for name in ("model.layers.1.self_attn.qkv_proj.weight", "model.layers.1.mlp.gate_up_proj.weight"):
            assert torch.equal(model.get_parameter(name), want.get_parameter(name)), (rank, name)
        assert not model.get_parameter("model.layers.0.self_attn.qkv_proj.weight").any()
