"""The sparse MoE block (layers/moe.py) against transformers' own blocks (Qwen3-MoE's and
Mixtral's, same weights), in float32 exactly up to summation order, in bfloat16 and w8a8 int8
within their rounding; its tensor-parallel shards summing to the whole block; the router kept
in the model dtype under w8a8."""
from __future__ import annotations

import pytest
import torch

from radixlm.config import ModelConfig
from radixlm.srt.distributed.layout import TPLayout
from radixlm.srt.layers.moe import SparseMoE, moe_param_target, route

HIDDEN, INTER = 64, 40


def _hf_block(kind: str, experts: int, top_k: int, norm: bool):
    torch.manual_seed(3)
    if kind == "qwen3_moe":
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
        cfg = Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=INTER, num_experts=experts,
                             num_experts_per_tok=top_k, norm_topk_prob=norm)
        block = Qwen3MoeSparseMoeBlock(cfg)
    else:
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
        cfg = MixtralConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=experts,
                            num_experts_per_tok=top_k)
        block = MixtralSparseMoeBlock(cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.3)
    return block.eval()


def _hf_named(block, prefix: str = "model.layers.0.mlp") -> list[tuple[str, torch.Tensor]]:
    """The block's tensors under their checkpoint names (per-expert gate/up/down)."""
    ex = block.experts
    named = [(f"{prefix}.gate.weight", block.gate.weight.detach())]
    for e in range(ex.gate_up_proj.shape[0]):
        gate, up = ex.gate_up_proj[e].detach().chunk(2, dim=0)
        named += [(f"{prefix}.experts.{e}.gate_proj.weight", gate), (f"{prefix}.experts.{e}.up_proj.weight", up),
                  (f"{prefix}.experts.{e}.down_proj.weight", ex.down_proj[e].detach())]
    return named


def _ours(named, experts: int, top_k: int, norm: bool, dtype=torch.float32, inter: int = INTER) -> SparseMoE:
    moe = SparseMoE(HIDDEN, inter, experts, top_k, norm, dtype)
    params = dict(moe.named_parameters())
    with torch.no_grad():
        for name, t in named:
            target = moe_param_target(name, inter)
            assert target is not None, name
            pname, off, rows = target
            dest = params[pname.removeprefix("model.layers.0.mlp.")]
            (dest if rows < 0 else dest.narrow(0, off, rows)).copy_(t)
    return moe


def _hf_out(block, x: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        out = block(x.unsqueeze(0))
    return (out[0] if isinstance(out, tuple) else out)[0].float()


@pytest.mark.parametrize("kind,experts,top_k,norm", [("qwen3_moe", 8, 4, True), ("qwen3_moe", 8, 2, False),
                                                     ("mixtral", 4, 2, True), ("qwen3_moe", 6, 1, False)])
@pytest.mark.parametrize("tokens", [1, 3, 37])
def test_float32_equals_transformers_block(kind, experts, top_k, norm, tokens):
    block = _hf_block(kind, experts, top_k, norm)
    moe = _ours(_hf_named(block), experts, top_k, norm)
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens))
    with torch.inference_mode():
        got = moe.forward(x)
    torch.testing.assert_close(got, _hf_out(block, x), atol=2e-5, rtol=1e-5)


def test_experts_without_tokens_and_empty_batches():
    """Few tokens leave most experts idle; zero tokens give an empty output."""
    block = _hf_block("qwen3_moe", 8, 2, True)
    moe = _ours(_hf_named(block), 8, 2, True)
    x = torch.randn(2, HIDDEN, generator=torch.Generator().manual_seed(1))
    _, ids = route(moe.gate.forward(x), 2, True)
    assert len(set(ids.flatten().tolist())) < 8
    with torch.inference_mode():
        torch.testing.assert_close(moe.forward(x), _hf_out(block, x), atol=2e-5, rtol=1e-5)
        assert moe.forward(x[:0]).shape == (0, HIDDEN)


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b).norm() / b.norm())


@pytest.mark.parametrize("dtype,quant,bound", [(torch.bfloat16, None, 0.02), (torch.float32, "w8a8_int8", 0.05),
                                               (torch.bfloat16, "w8a8_int8", 0.05)])
def test_bf16_and_int8_close_to_float32(dtype, quant, bound):
    """Relative error of the whole block's output: bf16 rounding (~0.4% per op) and int8's
    per-channel / per-32-group quantization (~1-2%), with the same routing as float32 (the
    router is not quantized, and these inputs have no near-ties between the k-th experts)."""
    block = _hf_block("qwen3_moe", 8, 4, True)
    ref_moe = _ours(_hf_named(block), 8, 4, True)
    moe = _ours(_hf_named(block), 8, 4, True, dtype=dtype)
    x = torch.randn(29, HIDDEN, generator=torch.Generator().manual_seed(5))
    for m in moe.modules():
        if hasattr(m, "quantization"):
            m.quantization = quant
    with torch.inference_mode():
        ref = ref_moe.forward(x)
        got = moe.forward(x.to(dtype))
    assert got.dtype == dtype
    assert moe.gate.quantization is None  # the router ignores the model-wide quantization
    if quant is not None:
        assert all(e.gate_up_proj.quantization == quant and e.down_proj.quantization == quant for e in moe.experts)
    assert _rel_err(got, ref) < bound


def test_tensor_parallel_shards_sum_to_the_whole_block():
    """Each rank keeps its rows of every expert's gate/up and columns of its down_proj
    (TPLayout.shard on the checkpoint names) and the whole router; the ranks' outputs summed
    (the all-reduce) are the unsharded block's. 40 rows over 3 ranks: 14 + 13 + 13."""
    block = _hf_block("qwen3_moe", 8, 4, True)
    named = _hf_named(block)
    whole = _ours(named, 8, 4, True)
    cfg = ModelConfig(hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                      intermediate_size=128, vocab_size=64, num_experts=8, num_experts_per_tok=4,
                      moe_intermediate_size=INTER)
    x = torch.randn(9, HIDDEN, generator=torch.Generator().manual_seed(2))
    total = torch.zeros(9, HIDDEN)
    sizes = []
    for rank in range(3):
        layout = TPLayout.build(cfg, 3, rank)
        local = layout.local_config(cfg)
        sizes.append(local.moe_intermediate_size)
        part = []
        for name, t in named:
            s = layout.shard(name)
            if name.endswith("gate.weight"):
                assert s is None  # the router is replicated
            part.append((name, t if s is None else t.narrow(s.dim, s.start, s.stop - s.start)))
        with torch.inference_mode():
            total += _ours(part, 8, 4, True, inter=local.moe_intermediate_size).forward(x)
    assert sizes == [14, 13, 13]
    with torch.inference_mode():
        torch.testing.assert_close(total, whole.forward(x), atol=2e-5, rtol=1e-5)


def test_mixtral_names_and_layout():
    assert moe_param_target("model.layers.3.block_sparse_moe.experts.5.w3.weight", 24) == \
        ("model.layers.3.mlp.experts.5.gate_up_proj.weight", 24, 24)
    assert moe_param_target("model.layers.3.block_sparse_moe.experts.5.w2.weight", 24) == \
        ("model.layers.3.mlp.experts.5.down_proj.weight", 0, -1)
    assert moe_param_target("model.layers.3.block_sparse_moe.gate.weight", 24) == \
        ("model.layers.3.mlp.gate.weight", 0, -1)
    assert moe_param_target("model.layers.3.mlp.gate_proj.weight", 24) is None  # a dense MLP's
    cfg = ModelConfig(hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      intermediate_size=50, vocab_size=64, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=50)
    lay = TPLayout.build(cfg, 2, 1)
    assert lay.shard("model.layers.0.block_sparse_moe.experts.1.w1.weight") == lay.shard(
        "model.layers.0.block_sparse_moe.experts.1.w3.weight")
    s = lay.shard("model.layers.0.block_sparse_moe.experts.1.w2.weight")
    assert s is not None and (s.dim, s.start, s.stop, s.full) == (1, 25, 50, 50)
    with pytest.raises(ValueError, match="expert intermediate size"):
        TPLayout.build(ModelConfig(**{**cfg.__dict__, "moe_intermediate_size": 1}), 2, 0)
