"""RMSNorm, rotary embedding and gated MLP against the transformers Llama modules."""
from __future__ import annotations

import pytest
import torch

from radixlm.srt.layers.activation import GatedMLP
from radixlm.srt.layers.norm import RMSNorm
from radixlm.srt.layers.rotary import RotaryEmbedding, apply_rotary, compute_inv_freq


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_matches_hf(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    x, res = torch.randn(7, 64).to(dtype), torch.randn(7, 64).to(dtype)
    ref = LlamaRMSNorm(64, eps=1e-5).to(dtype)
    with torch.no_grad():
        ref.weight.normal_()
    ours = RMSNorm(64, 1e-5, dtype)
    ours.weight.data.copy_(ref.weight.data)
    with torch.no_grad():
        tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(ours(x), ref(x), **tol)
        total = x + res
        out, new_res = ours(x, res)  # may update res in place (the residual stream is private)
        torch.testing.assert_close(new_res, total, atol=0, rtol=0)
        torch.testing.assert_close(out, ref(total), **tol)


_SCALINGS = [
    None,
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 1024},
]


@pytest.mark.parametrize("scaling", _SCALINGS, ids=["default", "linear", "llama3"])
def test_rotary_matches_hf(scaling):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    head_dim, theta = 32, 500000.0
    rope = {"rope_type": "default", "rope_theta": theta} if scaling is None else {**scaling, "rope_theta": theta}
    cfg = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, max_position_embeddings=4096,
                      rope_parameters=rope)
    hf_rope = LlamaRotaryEmbedding(cfg)
    torch.testing.assert_close(compute_inv_freq(head_dim, theta, scaling), hf_rope.inv_freq, atol=0, rtol=0)

    torch.manual_seed(0)
    positions = torch.tensor([0, 1, 2, 900, 3000, 4095, 5000])  # 5000: past max -> cache grows
    q, k = torch.randn(len(positions), 4, head_dim), torch.randn(len(positions), 2, head_dim)
    cos, sin = hf_rope(q, positions[None])
    # HF works on [B, heads, T, D]
    q_ref, k_ref = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    ours = RotaryEmbedding(head_dim, 4096, theta, scaling)
    c, s = ours.cos_sin(positions, torch.float32)
    qk = apply_rotary(torch.cat([q, k], dim=1), c, s)
    torch.testing.assert_close(qk[:, :4], q_ref[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(qk[:, 4:], k_ref[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours(positions, q), qk[:, :4], atol=0, rtol=0)


def test_unknown_rope_scaling_rejected():
    with pytest.raises(ValueError, match=r"'ntk-by-parts' is not supported \(supported: default, linear, llama3, "
                                         r"yarn, dynamic, longrope\)"):
        compute_inv_freq(64, 10000.0, {"rope_type": "ntk-by-parts", "factor": 2.0})
    with pytest.raises(ValueError, match="lacks factor"):
        compute_inv_freq(64, 10000.0, {"type": "linear"})


def test_gated_mlp_matches_hf():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(0)
    ref = LlamaMLP(LlamaConfig(hidden_size=32, intermediate_size=48))
    ours = GatedMLP(32, 48)
    with torch.no_grad():
        ours.gate_up_proj.weight.copy_(torch.cat([ref.gate_proj.weight, ref.up_proj.weight]))
        ours.down_proj.weight.copy_(ref.down_proj.weight)
        x = torch.randn(5, 32)
        torch.testing.assert_close(ours(x), ref(x), atol=1e-6, rtol=1e-6)
