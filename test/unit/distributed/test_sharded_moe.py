"""Qwen3-MoE and Mixtral split over tensor-parallel ranks (threads, test/support/thread_comm.py)
compute what the whole model computes: every expert's intermediate rows cut (unevenly here: 35
rows over 2 or 3 ranks), the router and the q/k norms whole on every rank; and a weight update
of full tensors (the RL API) lands in each rank's shard."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from radixlm.config import ModelConfig
from radixlm.srt.distributed.context import TPContext
from radixlm.srt.distributed.layout import TPLayout
from radixlm.srt.model_runner.weight_updater import WeightUpdater
from radixlm.srt.weights.safetensors_loader import take_shards
from test.support.sharded_model import random_weights, tiny_config
from test.support.thread_comm import run_ranks
from test.unit.distributed.test_sharded_model import _forwards

EXPERTS, MOE_INTER = 6, 35


def moe_config(arch: str) -> ModelConfig:
    base = tiny_config(4, 2, arch=arch, tied=False)
    return dataclasses.replace(base, num_experts=EXPERTS, num_experts_per_tok=2, moe_intermediate_size=MOE_INTER,
                               norm_topk_prob=arch == "MixtralForCausalLM",
                               mlp_only_layers=(1,) if arch == "Qwen3MoeForCausalLM" else ())


def moe_weights(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """random_weights' dense tensors, with each sparse layer's MLP replaced by a router and experts
    under the checkpoint's names (and Qwen3's q/k norms)."""
    g = torch.Generator().manual_seed(seed + 100)
    out = random_weights(cfg, seed)
    h, block = cfg.hidden_size, "block_sparse_moe" if cfg.architecture == "MixtralForCausalLM" else "mlp"
    names = ("w1", "w3", "w2") if block == "block_sparse_moe" else ("gate_proj", "up_proj", "down_proj")
    for n in range(cfg.num_hidden_layers):
        p = f"model.layers.{n}."
        if cfg.architecture.startswith("Qwen3"):
            out |= {p + "self_attn.q_norm.weight": 1 + 0.2 * torch.randn(cfg.head_dim, generator=g),
                    p + "self_attn.k_norm.weight": 1 + 0.2 * torch.randn(cfg.head_dim, generator=g)}
        if not cfg.is_sparse_layer(n):
            continue
        for k in ("gate_proj", "up_proj", "down_proj"):
            del out[p + f"mlp.{k}.weight"]
        out[p + f"{block}.gate.weight"] = torch.randn(EXPERTS, h, generator=g)
        for e in range(EXPERTS):
            q = p + f"{block}.experts.{e}."
            out |= {q + f"{names[0]}.weight": 0.2 * torch.randn(MOE_INTER, h, generator=g),
                    q + f"{names[1]}.weight": 0.2 * torch.randn(MOE_INTER, h, generator=g),
                    q + f"{names[2]}.weight": 0.2 * torch.randn(h, MOE_INTER, generator=g)}
    return out


def _check(cfg: ModelConfig, tp_size: int) -> None:
    weights = moe_weights(cfg, 3)
    whole = _forwards(cfg, weights, TPContext.single(cfg), "torch_native", None)
    per_rank = run_ranks(tp_size, lambda comm: _forwards(
        cfg, weights, TPContext(TPLayout.build(cfg, tp_size, comm.rank), comm), "torch_native", None))
    for rank_logits in per_rank:
        for a, b in zip(rank_logits, whole):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    for a, b in zip(per_rank[0], per_rank[-1]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("arch,tp", [("Qwen3MoeForCausalLM", 2), ("Qwen3MoeForCausalLM", 3),
                                     ("MixtralForCausalLM", 2)])
def test_split_matches_whole(arch, tp):
    _check(moe_config(arch), tp)


def test_shapes_per_rank():
    cfg = moe_config("Qwen3MoeForCausalLM")
    sizes = [TPLayout.build(cfg, 2, r).local_config(cfg).moe_intermediate_size for r in range(2)]
    assert sizes == [18, 17]


def test_weight_update_of_full_tensors_lands_in_each_shard():
    """update_weights_from_tensor under TP: full expert tensors in, each rank keeps its rows of
    gate/up and columns of down_proj; the router whole. The ranks' models then compute the
    whole updated model's logits."""
    cfg = moe_config("MixtralForCausalLM")
    weights = moe_weights(cfg, 3)
    g = torch.Generator().manual_seed(9)
    new = {n: weights[n] + 0.1 * torch.randn(weights[n].shape, generator=g)
           for n in ("model.layers.0.block_sparse_moe.experts.2.w1.weight",
                     "model.layers.0.block_sparse_moe.experts.2.w2.weight",
                     "model.layers.1.block_sparse_moe.gate.weight")}

    def updated(tp: TPContext):
        from radixlm.srt.models.registry import build_model

        model = build_model(cfg, torch.float32, "cpu", tp)
        model.load_weights(take_shards(weights.items(), tp.layout.shard if tp.size > 1 else None))
        assert WeightUpdater(model).update(new.items()) == len(new)
        return model

    whole = updated(TPContext.single(cfg))
    for rank, part in enumerate(run_ranks(2, lambda comm: updated(TPContext(TPLayout.build(cfg, 2, comm.rank), comm)))):
        p = dict(part.named_parameters())
        w = dict(whole.named_parameters())
        gu = "model.layers.0.mlp.experts.2.gate_up_proj.weight"
        lo, hi = (0, 18) if rank == 0 else (18, 35)
        assert torch.equal(p[gu][:hi - lo], w[gu][lo:hi])  # gate rows
        dn = "model.layers.0.mlp.experts.2.down_proj.weight"
        assert torch.equal(p[dn], w[dn][:, lo:hi])
        assert torch.equal(p["model.layers.1.mlp.gate.weight"], w["model.layers.1.mlp.gate.weight"])
