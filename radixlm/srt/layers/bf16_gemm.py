"""bfloat16 linear on radixlm's own AVX512-BF16 GEMM (kernels/cpu/bf16_gemm.cpp), for CPUs
with bf16 dot products (AVX512-BF16: AMD Zen 4, Intel Sapphire Rapids and later); on CPUs with
AMX the same packed weight is multiplied on tiles (bf16_gemm_amx.h), 5-10x faster from 32 rows.

Why: there torch's bf16 linear goes through oneDNN, which at decode batch sizes on two cores
reaches a third to a half of the vdpbf16ps peak even with its weight prepacked; the bf16 GEMMs
are the largest part of a bf16 decode step. The kernel multiplies through a copy of the weight
packed once into 64-column panels with consecutive k interleaved in pairs, accumulating in
float32 and rounding once to the output dtype: the numbers of torch's bf16 linear up to the
order of the float32 summation. Each row's result does not depend on the rows beside it.

Like the other packed copies (linear.py) it is derived state, dropped by
Linear.invalidate_packed() when the weight changes; RADIXLM_BF16_GEMM=0 goes back to oneDNN.

A gated MLP's gate_up is packed silu-gated (gate_up_order.py: 32 gate and the 32 matching up
rows per panel) and `linear_silu` returns silu(gate) * up from the GEMM's epilogue, bit for bit
the plain GEMM followed by silu_mul.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import radixlm.envs as envs
from radixlm.kernels.cpu import ops
from radixlm.kernels.cpu.hugepages import empty_hugepage
from radixlm.srt.layers.float_gemm import padded_rows
from radixlm.srt.layers.gate_up_order import can_gate, gate_up_order, silu_gated_order

PANEL = 64  # output columns per panel (bf16_gemm.cpp kNR)


@dataclass
class PackedBf16Weight:
    out_features: int
    in_features: int
    panels: torch.Tensor  # [ceil(out / 64), in / 2, 64, 2] bfloat16
    silu_gated: bool = False  # rows in silu_gated_order (a gate_up weight): linear_silu applies


def available() -> bool:
    return ops.bf16_gemm_available()


def wanted(dtype: torch.dtype, device: torch.device | str, in_features: int) -> bool:
    """Whether a Linear of this dtype/device/width should multiply through this kernel."""
    return (dtype == torch.bfloat16 and torch.device(device).type == "cpu" and in_features % 2 == 0
            and envs.bf16_gemm_enabled() and available())


def pack_weight(weight: torch.Tensor, silu_gated: bool = False) -> PackedBf16Weight:
    """panels[p, k2, c, i] = weight[64 p + c, 2 k2 + i], zero-padded to whole panels.
    silu_gated: a gated MLP's [gate; up], packed in silu_gated_order where it fills whole panels."""
    with torch.inference_mode(False), torch.no_grad():
        n, k = weight.shape
        gated = silu_gated and can_gate(n, PANEL)
        w = padded_rows(silu_gated_order(weight, PANEL) if gated else weight, PANEL)
        panels = empty_hugepage((w.shape[0] // PANEL, k // 2, PANEL, 2), torch.bfloat16)  # streamed every step
        panels.copy_(w.view(-1, PANEL, k // 2, 2).transpose(1, 2))
        return PackedBf16Weight(n, k, panels, gated)


def linear(x: torch.Tensor, weight: PackedBf16Weight, bias: torch.Tensor | None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """x [..., in] bfloat16 (bias, if given, bfloat16) -> [..., out] in out_dtype (default
    x.dtype); None when the kernel does not take these inputs (the caller falls back to torch)."""
    out_dtype = out_dtype or x.dtype
    if weight.silu_gated and bias is not None:
        bias = silu_gated_order(bias, PANEL)
    out = _call(x, weight, bias, out_dtype, silu=False)
    if out is not None and weight.silu_gated:  # not the MLP's own path (linear_silu): rows back in order
        out = gate_up_order(out, PANEL)
    return out


def argmax(x: torch.Tensor, weight: PackedBf16Weight, n_cols: int) -> torch.Tensor | None:
    """linear(x, weight, None)[:, :n_cols].argmax(-1) for x [M, in] bfloat16, without the output
    (greedy sampling off an LM head); None where the kernel does not offer it."""
    if weight.silu_gated or x.dim() != 2:
        return None
    return ops.bf16_linear_argmax(x, weight.panels, weight.out_features, n_cols)


def linear_silu(x: torch.Tensor, weight: PackedBf16Weight, bias: torch.Tensor | None) -> torch.Tensor | None:
    """silu(gate) * up of a silu-gated gate_up weight: x [..., in] bfloat16 -> [..., out / 2]
    bfloat16, bias in the [gate | up] order of the float weight; None as `linear`."""
    if bias is not None:
        bias = silu_gated_order(bias, PANEL)
    return _call(x, weight, bias, x.dtype, silu=True)


def _call(x: torch.Tensor, weight: PackedBf16Weight, bias: torch.Tensor | None, out_dtype: torch.dtype,
          silu: bool) -> torch.Tensor | None:
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = ops.bf16_linear(x2, weight.panels, weight.out_features, bias, out_dtype, silu=silu)
    return None if out is None else out.reshape(*lead, out.shape[-1])
