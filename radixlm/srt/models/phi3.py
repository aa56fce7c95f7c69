"""Phi-3 / Phi-3.5 / Phi-4-mini (`Phi3ForCausalLM`).

The graph is Llama's: pre-norm blocks, neox rope (over the first `partial_rotary_factor` of each
head), GQA, a SiLU-gated MLP. The checkpoint already fuses q/k/v (`qkv_proj`, rows [q; k; v])
and gate/up (`gate_up_proj`, rows [gate; up]) in the layout of radixlm's own fused matrices, so
on one rank those tensors load as they are. A tensor-parallel rank holds a slice of each of q,
k and v (of gate and up): `split_fused` cuts the fused tensors into the Llama names first, which
the layout shards as for Llama. The long-context variants use `longrope` (rope_scaling.py).
"""
from __future__ import annotations

from typing import Iterable, Iterator

import torch

from radixlm.config import ModelConfig
from radixlm.srt.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    """Llama's graph; Phi-3's fused checkpoint names (see the module docstring)."""

    @staticmethod
    def split_fused(named: Iterable[tuple[str, torch.Tensor]], config: ModelConfig
                    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Checkpoint tensors with qkv_proj / gate_up_proj cut into the Llama projections."""
        q = config.num_attention_heads * config.head_dim
        kv = config.num_key_value_heads * config.head_dim
        inter = config.intermediate_size
        for name, tensor in named:
            prefix, _, leaf = name.rpartition(".")
            if prefix.endswith("self_attn.qkv_proj"):
                base = prefix[:-len("qkv_proj")]
                if tensor.shape[0] != q + 2 * kv:
                    raise ValueError(f"{name}: {tensor.shape[0]} rows, the config needs {q + 2 * kv}")
                for part, rows in zip(("q_proj", "k_proj", "v_proj"), tensor.split([q, kv, kv])):
                    yield f"{base}{part}.{leaf}", rows
            elif prefix.endswith("mlp.gate_up_proj"):
                base = prefix[:-len("gate_up_proj")]
                if tensor.shape[0] != 2 * inter:
                    raise ValueError(f"{name}: {tensor.shape[0]} rows, the config needs {2 * inter}")
                gate, up = tensor.split([inter, inter])
                yield f"{base}gate_proj.{leaf}", gate
                yield f"{base}up_proj.{leaf}", up
            else:
                yield name, tensor
