"""Gated MLPs (gate/up/down) with gate and up fused into one matmul: SiLU (Llama) or GELU-tanh
(Gemma)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixlm.kernels.cpu import ops as cpu_ops
from radixlm.srt.layers import bf16_gemm
from radixlm.srt.layers.int8_linear import int8_linear_silu
from radixlm.srt.layers.linear import Linear


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2*I] (gate then up) -> silu(gate) * up, [..., I]. On CPU one native pass
    (rounded once, where torch rounds silu(gate) before the multiply)."""
    if gate_up.dim() == 2 and gate_up.device.type == "cpu":
        out = cpu_ops.silu_mul(gate_up)
        if out is not None:
            return out
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2*I] (gate then up) -> gelu_tanh(gate) * up, [..., I] (Hugging Face's
    gelu_pytorch_tanh)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype | None = None,
                 activation: str = "silu") -> None:
        super().__init__()
        if activation not in ("silu", "gelu_pytorch_tanh"):
            raise ValueError(f"MLP activation {activation!r} is not supported (silu, gelu_pytorch_tanh)")
        self.intermediate_size = intermediate_size
        self.activation = activation
        # Rows [0, I) hold gate_proj, rows [I, 2I) up_proj: one GEMM instead of two. Only SiLU
        # has the GEMMs' fused epilogue (silu_gated reorders the packed columns for it).
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, dtype=dtype,
                                   silu_gated=activation == "silu")
        self.down_proj = Linear(intermediate_size, hidden_size, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation != "silu":
            return self.down_proj.forward(gelu_tanh_and_mul(self.gate_up_proj.forward(x)))
        return self.down_proj.forward(self._silu_mul_gate_up(x))

    def _silu_mul_gate_up(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj
        if gate_up.quantization is not None:
            w = gate_up.int8_weight()
            if w.silu_gated:  # SiLU * mul in the int8 GEMM's epilogue
                return int8_linear_silu(x, w, gate_up.bias)
        else:
            packed = gate_up.packed_weight()
            if isinstance(packed, bf16_gemm.PackedBf16Weight) and packed.silu_gated:  # in the bf16 GEMM's
                out = bf16_gemm.linear_silu(x, packed, gate_up.bias)
                if out is not None:
                    return out
        return silu_and_mul(gate_up.forward(x))
