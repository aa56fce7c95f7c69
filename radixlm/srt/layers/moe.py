"""Sparse mixture-of-experts block (Qwen3-MoE, Mixtral) on the CPU.

A router (one [experts, hidden] matrix) scores every token; softmax over the experts, the
top k kept (renormalised to sum to 1 where the model asks: Qwen3-MoE's `norm_topk_prob`,
Mixtral always). The (token, expert) pairs are then sorted by expert, so each active expert
sees its tokens as one contiguous block of rows: one gated-MLP forward per active expert over
its rows, through the same `Linear`s as the dense MLP (radixlm's bf16/float panel GEMMs,
int8 under w8a8, the SiLU * mul epilogue). The expert outputs are gathered back into (token,
slot) order and each token's k outputs summed with their routing weights in float32, cast to
the model dtype once.

The router stays in the model dtype under w8a8 (SGLang leaves the gate unquantized too): a
rounding of its logits flips which experts a token reaches, far more than it moves the
output of one.

Tensor parallelism cuts each expert's intermediate dimension (TPLayout.moe_intermediate):
every rank routes identically (replicated router, identical input) and returns its part of
every expert's down_proj sum, which the decoder layer all-reduces as it does the dense MLP's.
"""
from __future__ import annotations

import re

import torch
from torch import nn

from radixlm.srt.layers.activation import GatedMLP
from radixlm.srt.layers.linear import Linear


class RouterLinear(Linear):
    """The router's [experts, hidden] matrix: a Linear (packed like the others) that ignores
    a model-wide quantization."""

    @property  # type: ignore[override]
    def quantization(self) -> str | None:
        return None

    @quantization.setter
    def quantization(self, method: str | None) -> None:
        pass


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights float32 [T, k], expert ids int64 [T, k]): the top k of
    the softmax over the experts, as transformers' Qwen3-MoE and Mixtral routers choose them."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class SparseMoE(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 renormalize: bool, dtype: torch.dtype | None = None) -> None:
        """`intermediate_size`: each expert's rows on this rank."""
        super().__init__()
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.gate = RouterLinear(hidden_size, num_experts, dtype=dtype)
        self.experts = nn.ModuleList(GatedMLP(hidden_size, intermediate_size, dtype) for _ in range(num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> this rank's part of the weighted expert sum [T, hidden]."""
        t = x.shape[0]
        if t == 0:
            return x.new_zeros((0, self.hidden_size))
        weights, ids = route(self.gate.forward(x), self.top_k, self.renormalize)
        flat = ids.view(-1)
        # Stable: within an expert its tokens keep their order (the GEMM sees rows as they came).
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        grouped = x.index_select(0, order // self.top_k)  # every expert's rows contiguous, in expert order
        outs = torch.empty_like(grouped)
        start = 0
        for e, n in enumerate(counts):
            if n:
                outs[start:start + n] = self.experts[e].forward(grouped[start:start + n])
                start += n
        # Back to (token, slot) order by a gather, then the weighted sum over the k slots in
        # float32: index_add_ into the tokens' rows was 100x slower on 2 busy cores (its
        # parallel scatter waits on a descheduled thread, once per expert).
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        per_slot = outs.index_select(0, inverse).view(t, self.top_k, self.hidden_size)
        out = torch.bmm(weights.unsqueeze(1), per_slot.float()).squeeze(1)
        return out.to(x.dtype)


# Hugging Face names of a sparse block's tensors: Qwen3-MoE's mlp.gate / mlp.experts.E.{gate,up,down}_proj,
# Mixtral's block_sparse_moe.gate / block_sparse_moe.experts.E.{w1,w3,w2}.
_MOE_NAME = re.compile(r"^(.*\.)(mlp|block_sparse_moe)\.(gate|experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3))"
                       r"\.(weight)$")
_GATE_UP_ROW = {"gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1}


def moe_param_target(name: str, intermediate_size: int) -> tuple[str, int, int] | None:
    """A sparse block's Hugging Face tensor name -> (our parameter name, row offset, row count)
    (rows -1: the whole parameter), or None when `name` is not one. Gate and up of an expert
    fill the two halves of its fused gate_up_proj; `intermediate_size` is this rank's."""
    m = _MOE_NAME.match(name)
    if m is None:
        return None
    layer, _, part, expert, proj, leaf = m.groups()
    if part == "gate":
        return f"{layer}mlp.gate.{leaf}", 0, -1
    base = f"{layer}mlp.experts.{expert}"
    if proj in _GATE_UP_ROW:
        return f"{base}.gate_up_proj.{leaf}", _GATE_UP_ROW[proj] * intermediate_size, intermediate_size
    return f"{base}.down_proj.{leaf}", 0, -1

