"""Float32/bfloat16 linear on radixlm's own AVX2 + FMA GEMM (kernels/cpu/float_gemm.cpp): every
float32 Linear on an AVX2 CPU, and bfloat16 ones on CPUs without bf16 dot products (no AMX, no
AVX512-BF16: e.g. AMD Zen 3).

Why bf16 there: torch's bf16 matmul is emulated, 4-8x slower than its fp32 one, and its fp32
one reaches ~40% of the FMA peak at decode batch sizes (benchmark/micro/roofline.py).
Why float32 everywhere: a row's result must not depend on how many rows are multiplied with it
(speculative verification extends K tokens and must give the logits of K one-token decode steps
bit for bit). This kernel computes every row alike; torch's float32 GEMM on AVX-512 (MKL) runs
rows in blocks of 4 and the leftover rows through another kernel, ~1e-7 apart, and measured on
Zen 4 (2 cores, SmolLM2 shapes) it is also 1.1-4x slower than this one up to 64 rows. The kernel
multiplies through a copy of the weight packed once into 16-column panels, accumulating in
float32 and rounding once to the output dtype: the numbers of torch's float32 linear (a
bfloat16 model: of torch's bfloat16 linear, which also accumulates in float32) up to the
order of the float32 summation.

The panels hold the weight in its own dtype: bf16 weights stay bf16 (half the bytes streamed
per decode step) and are widened in registers. Like the oneDNN-packed copy in linear.py the
packed copy is derived state, dropped by Linear.invalidate_packed() when the weight changes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import radixlm.envs as envs
from radixlm.kernels.cpu import ops
from radixlm.kernels.cpu.hugepages import empty_hugepage

PANEL = 16  # output columns per panel (float_gemm.cpp kNR)


@dataclass
class PackedFloatWeight:
    out_features: int
    in_features: int
    panels: torch.Tensor  # [ceil(out / 16), in, 16], the weight's dtype


def available() -> bool:
    return ops.float_gemm_available()


def wanted(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether a Linear of this dtype/device should multiply through this kernel: float32 on
    every AVX2 CPU, bfloat16 on CPUs where torch's own GEMMs lack a fast bf16 path (there the
    oneDNN-packed bf16 matmul wins); RADIXLM_FLOAT_GEMM=0 turns it off, =1 forces it for
    bfloat16 on any AVX2 CPU."""
    forced = envs.float_gemm_forced()
    if forced is False or dtype not in (torch.float32, torch.bfloat16) or torch.device(device).type != "cpu":
        return False
    if not available():
        return False
    if forced or dtype == torch.float32:
        return True
    from radixlm.srt.weights.loader import cpu_has_fast_bf16
    return not cpu_has_fast_bf16()


def pack_weight(weight: torch.Tensor) -> PackedFloatWeight:
    """panels[p, k, c] = weight[16 p + c, k], zero-padded to whole panels."""
    with torch.inference_mode(False), torch.no_grad():
        n, k = weight.shape
        w = padded_rows(weight, PANEL)
        panels = empty_hugepage((w.shape[0] // PANEL, k, PANEL), weight.dtype)  # streamed every step
        panels.copy_(w.view(-1, PANEL, k).transpose(1, 2))
        return PackedFloatWeight(n, k, panels)


def padded_rows(weight: torch.Tensor, multiple: int) -> torch.Tensor:
    """The weight (detached) with zero output rows appended up to a multiple of `multiple`."""
    n, k = weight.shape
    w = weight.detach()
    pad = -n % multiple
    return torch.cat([w, w.new_zeros(pad, k)]) if pad else w


def linear(x: torch.Tensor, weight: PackedFloatWeight, bias: torch.Tensor | None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """x [..., in] (float32/bfloat16) -> [..., out] in out_dtype (default x.dtype); None when the
    kernel does not take these inputs (the caller falls back to torch)."""
    out_dtype = out_dtype or x.dtype
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = ops.float_linear(x2, weight.panels, weight.out_features, bias, out_dtype)
    return None if out is None else out.reshape(*lead, weight.out_features)
