"""Row orders of a gated MLP's gate_up weight for the GEMMs that apply SiLU * mul in their
epilogue (int8_linear.py, bf16_gemm.py): a packing unit of `unit` output columns (the int8
GEMM's 32-column tile, the bf16 GEMM's 64-column panel) holds unit / 2 gate rows and the
unit / 2 matching up rows, so one unit's outputs give unit / 2 outputs of silu(gate) * up."""
from __future__ import annotations

import torch


def can_gate(rows: int, unit: int) -> bool:
    """Whether a [gate; up] weight of `rows` rows fills whole units (I a multiple of unit / 2)."""
    return rows > 0 and rows % unit == 0


def silu_gated_order(t: torch.Tensor, unit: int) -> torch.Tensor:
    """[gate; up] along the first dimension (2I rows, can_gate) -> per unit: unit / 2 gate
    rows, then the unit / 2 up rows of the same columns."""
    return t.reshape(2, t.shape[0] // unit, unit // 2, *t.shape[1:]).transpose(0, 1).reshape(t.shape).contiguous()


def gate_up_order(t: torch.Tensor, unit: int) -> torch.Tensor:
    """The inverse of silu_gated_order, over the last dimension: [..., unit order] -> [..., gate | up]."""
    cols, lead = t.shape[-1], t.shape[:-1]
    return t.reshape(*lead, cols // unit, 2, unit // 2).transpose(-3, -2).reshape(*lead, cols)
