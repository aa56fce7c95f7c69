"""bfloat16 linear on radixlm's own AVX512-BF16 GEMM (kernels/cpu/bf16_gemm.cpp), for CPUs
with bf16 dot products (AVX512-BF16: AMD Zen 4, Intel Sapphire Rapids and later).

Why: there torch's bf16 linear goes through oneDNN, which at decode batch sizes on two cores
reaches a third to a half of the vdpbf16ps peak even with its weight prepacked; the bf16 GEMMs
are the largest part of a bf16 decode step. The kernel multiplies through a copy of the weight
packed once into 64-column panels with consecutive k interleaved in pairs, accumulating in
float32 and rounding once to the output dtype: the numbers of torch's bf16 linear up to the
order of the float32 summation. Each row's result does not depend on the rows beside it.

Like the other packed copies (linear.py) it is derived state, dropped by
Linear.invalidate_packed() when the weight changes; RADIXLM_BF16_GEMM=0 goes back to oneDNN.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import radixlm.envs as envs
from radixlm.kernels.cpu import ops
from radixlm.kernels.cpu.hugepages import empty_hugepage
from radixlm.srt.layers.float_gemm import padded_rows

PANEL = 64  # output columns per panel (bf16_gemm.cpp kNR)


@dataclass
class PackedBf16Weight:
    out_features: int
    in_features: int
    panels: torch.Tensor  # [ceil(out / 64), in / 2, 64, 2] bfloat16


def available() -> bool:
    return ops.bf16_gemm_available()


def wanted(dtype: torch.dtype, device: torch.device | str, in_features: int) -> bool:
    """Whether a Linear of this dtype/device/width should multiply through this kernel."""
    return (dtype == torch.bfloat16 and torch.device(device).type == "cpu" and in_features % 2 == 0
            and envs.bf16_gemm_enabled() and available())


def pack_weight(weight: torch.Tensor) -> PackedBf16Weight:
    """panels[p, k2, c, i] = weight[64 p + c, 2 k2 + i], zero-padded to whole panels."""
    with torch.inference_mode(False), torch.no_grad():
        n, k = weight.shape
        w = padded_rows(weight, PANEL)
        panels = empty_hugepage((w.shape[0] // PANEL, k // 2, PANEL, 2), torch.bfloat16)  # streamed every step
        panels.copy_(w.view(-1, PANEL, k // 2, 2).transpose(1, 2))
        return PackedBf16Weight(n, k, panels)


def linear(x: torch.Tensor, weight: PackedBf16Weight, bias: torch.Tensor | None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """x [..., in] bfloat16 (bias, if given, bfloat16) -> [..., out] in out_dtype (default
    x.dtype); None when the kernel does not take these inputs (the caller falls back to torch)."""
    out_dtype = out_dtype or x.dtype
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = ops.bf16_linear(x2, weight.panels, weight.out_features, bias, out_dtype)
    return None if out is None else out.reshape(*lead, weight.out_features)
