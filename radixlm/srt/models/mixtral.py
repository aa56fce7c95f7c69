"""Mixtral: Llama's attention with a sparse block of `num_local_experts` experts in every
layer, top-2 (`num_experts_per_tok`) with the two weights renormalised to sum to 1.

Hugging Face names the block `block_sparse_moe` and an expert's projections w1 (gate), w3 (up)
and w2 (down); here they load into the same `mlp.gate` / `mlp.experts.E.gate_up_proj` /
`down_proj` parameters as Qwen3-MoE's (layers/moe.py `moe_param_target`). Mixtral's
`sliding_window` is not applied (as for Mistral: full attention).
"""
from __future__ import annotations

import torch
from torch import nn

from radixlm.config import ModelConfig
from radixlm.srt.models.llama import LlamaDecoderLayer
from radixlm.srt.models.qwen3_moe import MoEParamNames, make_moe_mlp


class MixtralDecoderLayer(LlamaDecoderLayer):
    def make_mlp(self, config: ModelConfig, layer_id: int, dtype: torch.dtype) -> nn.Module:
        return make_moe_mlp(config, layer_id, dtype)


class MixtralForCausalLM(MoEParamNames):
    layer_cls = MixtralDecoderLayer
