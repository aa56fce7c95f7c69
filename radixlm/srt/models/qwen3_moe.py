"""Qwen3-MoE: Qwen3's attention (q/k norms) with sparse mixture-of-experts blocks.

Layer i has a sparse block when the model has experts, i is not in `mlp_only_layers` and
(i + 1) is a multiple of `decoder_sparse_step` (Qwen3-30B-A3B: every layer); the others keep
the dense gated MLP of `intermediate_size`. The block (layers/moe.py) routes each token to
`num_experts_per_tok` of `num_experts` experts of `moe_intermediate_size`, its weights
renormalised where `norm_topk_prob` is set.
"""
from __future__ import annotations

import torch
from torch import nn

from radixlm.config import ModelConfig
from radixlm.srt.layers.activation import GatedMLP
from radixlm.srt.layers.moe import SparseMoE, moe_param_target
from radixlm.srt.models.llama import LlamaForCausalLM
from radixlm.srt.models.qwen3 import Qwen3DecoderLayer


def make_moe_mlp(config: ModelConfig, layer_id: int, dtype: torch.dtype) -> nn.Module:
    """A sparse block or, where the config keeps the layer dense, a gated MLP (`config`: this rank's shapes)."""
    if not config.is_sparse_layer(layer_id):
        return GatedMLP(config.hidden_size, config.intermediate_size, dtype)
    return SparseMoE(config.hidden_size, config.moe_intermediate_size, config.num_experts,
                     config.num_experts_per_tok, config.norm_topk_prob, dtype)


class MoEParamNames(LlamaForCausalLM):
    """Loading by Hugging Face name for models with sparse blocks: an expert's gate and up fill
    its fused gate_up_proj, as the dense MLP's do."""

    def _param_target(self, name: str) -> tuple[str, int, int] | None:
        target = moe_param_target(name, self.local_config.moe_intermediate_size)
        if target is None:
            return super()._param_target(name)
        self._invalidate_packed(target[0])
        return target


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    def make_mlp(self, config: ModelConfig, layer_id: int, dtype: torch.dtype) -> nn.Module:
        return make_moe_mlp(config, layer_id, dtype)


class Qwen3MoeForCausalLM(MoEParamNames):
    layer_cls = Qwen3MoeDecoderLayer
