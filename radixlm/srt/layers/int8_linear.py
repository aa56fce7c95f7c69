"""W8A8 int8 linear ("--quantization w8a8_int8"): int8 weights with one float32 scale per
output channel, activations quantized on the fly with one scale per GROUP consecutive
input features of each token (as llama.cpp's Q8_0), integer dot products per group.

Why: on CPU the decode step is bound by its GEMMs (batch 32) or by reading the weights
from DRAM (batch 1). vpdpbusd (AVX512-VNNI) multiplies bytes at twice the bf16 rate and an
int8 weight is half the bytes of a bf16 one; on AVX2-only CPUs (no bf16 or int8 dot
products) vpmaddubsw runs at ~1.6x the fp32 FMA peak (benchmark/micro/roofline.py). Why groups: measured on SmolLM2-135M against
float32 (9 chat prompts, 32 greedy tokens teacher-forced), one activation scale per token
gave top-1 agreement 0.88 and KL 0.04; groups of 32 give 0.955 and 0.006 (bf16: 0.97,
0.001), for ~15% more kernel time.

The native kernel (kernels/cpu/quant_ops.cpp) does quantize + GEMM + epilogue in one call
over a weight packed once into its layout (AVX512-VNNI or AVX2 code, the same numbers).
Without it (no compiler, a CPU without AVX2) the same
quantization runs in torch with a float matmul: same numbers up to float summation order.

The quantized weight is derived state, like the oneDNN-packed copy in linear.py: built
from the float master weight on first use and dropped when the weight is written (loader,
RL weight updates), so weight updates keep working in the float dtype users send.

A gated MLP's gate_up weight ([gate; up] rows, followed by SiLU * mul) is packed silu-gated:
each 32-column tile holds 16 gate rows and the 16 matching up rows, and `int8_linear_silu`
returns silu(gate) * up from the GEMM's epilogue, bit for bit the unfused pair (quant_ops.cpp).
At a decode batch that pair's separate pass was ~5% of a w8a8 step.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from radixlm.kernels.cpu import ops
from radixlm.kernels.cpu.hugepages import empty_hugepage
from radixlm.srt.layers.gate_up_order import can_gate, gate_up_order, silu_gated_order

QUANTIZATION_METHODS = ("w8a8_int8",)


GROUP = 32       # input features per activation scale (quant_ops.cpp kGroup)
TILE_COLS = 32   # output columns per tile of the packed layout (quant_ops.cpp kTileCols)
_NATIVE_DTYPES = (torch.float32, torch.bfloat16)  # rows the native kernel reads and writes


@dataclass
class Int8Weight:
    """A [out, in] weight as int8 with one float32 scale per output row, either packed for
    the native kernel or plain for the torch path."""
    out_features: int
    in_features: int
    scale: torch.Tensor                   # [out] float32 (padded to whole tiles when packed)
    qweight: torch.Tensor | None = None   # [out, in] int8 (torch path)
    packed: torch.Tensor | None = None    # tile layout of quant_ops.cpp (native path)
    comp: torch.Tensor | None = None      # [tiles, groups, 32] int32: 128 * sum of each group
    gemm: ops.Int8Gemm | None = None      # packed/comp/scale bound to the native kernel
    # Rows packed in the silu-gated tile order (gate_up only): gemm returns silu(gate) * up.
    silu_gated: bool = False


def check_quantization(method: str | None, device: str) -> None:
    """ValueError for a method this build cannot run on `device`."""
    if method is None:
        return
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"unknown quantization {method!r}; choose from {', '.join(QUANTIZATION_METHODS)}")
    if device != "cpu":
        raise ValueError(f"quantization {method!r} is implemented for the CPU only (device {device!r})")


def native_available() -> bool:
    return ops.int8_linear_available() and ops.int8_group_size() == GROUP


def quantize_weight(weight: torch.Tensor, pack: bool | None = None, silu_gated: bool = False) -> Int8Weight:
    """Symmetric per-output-channel int8 of a [out, in] float weight; packed for the native
    kernel when it is available (pack=None) or when asked. silu_gated: the weight is a gated
    MLP's [gate; up], packed in the silu-gated order where it is packed into whole tiles."""
    with torch.inference_mode(False), torch.no_grad():
        w = weight.detach().float()
        amax = w.abs().amax(dim=1)
        scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
        q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        if pack is None:
            pack = weight.device.type == "cpu" and native_available()
        if not pack:
            return Int8Weight(q.shape[0], q.shape[1], scale.contiguous(), qweight=q.contiguous())
        if silu_gated and can_gate(q.shape[0], TILE_COLS):
            return pack_int8_weight(silu_gated_order(q, TILE_COLS), silu_gated_order(scale, TILE_COLS),
                                    silu_gated=True)
        return pack_int8_weight(q, scale)


def pack_int8_weight(q: torch.Tensor, scale: torch.Tensor, silu_gated: bool = False) -> Int8Weight:
    """Tile layout: packed[t, kq, c, j] = q[32 t + c, 4 kq + j], zero-padded to whole tiles
    and groups; comp[t, g, c] = 128 * sum of q[32 t + c] over group g. See quant_ops.cpp.
    silu_gated: q's rows are already in silu_gated_order (whole tiles)."""
    n, k = q.shape
    n_pad, k_pad = -(-n // TILE_COLS) * TILE_COLS, -(-k // GROUP) * GROUP
    wp = torch.zeros(n_pad, k_pad, dtype=torch.int8)
    wp[:n, :k] = q
    tiles = n_pad // TILE_COLS
    packed = empty_hugepage((tiles, k_pad // 4, TILE_COLS, 4), torch.int8)  # streamed every step
    packed.copy_(wp.view(tiles, TILE_COLS, k_pad // 4, 4).permute(0, 2, 1, 3))
    group_sums = wp.view(tiles, TILE_COLS, k_pad // GROUP, GROUP).sum(dim=3, dtype=torch.int32)
    comp = empty_hugepage((tiles, k_pad // GROUP, TILE_COLS), torch.int32)  # read with each tile
    comp.copy_((group_sums * 128).permute(0, 2, 1))
    scale_pad = torch.ones(n_pad, dtype=torch.float32)
    scale_pad[:n] = scale
    gemm = ops.Int8Gemm(packed, comp, scale_pad, n, k, silu=silu_gated) if native_available() else None
    return Int8Weight(n, k, scale_pad, packed=packed, comp=comp, gemm=gemm, silu_gated=silu_gated)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch formulation of the kernel's quantizer: x [M, K] -> (q int8 [M, Kp] zero-padded
    to whole groups, scale float32 [M, Kp / GROUP])."""
    m, k = x.shape
    k_pad = -(-k // GROUP) * GROUP
    q, scale = quantize_last_dim(torch.nn.functional.pad(x.float(), (0, k_pad - k)).view(m, k_pad // GROUP, GROUP))
    return q.view(m, k_pad), scale


def quantize_last_dim(xf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 over the last dimension of float32 xf: (q int8, same shape; scale float32
    = amax / 127, one per row). q = round-half-even(x * (127 / amax)); an all-zero row has
    scale 0 and q 0. The activations' groups and the int8 KV cache's heads use it."""
    # 127 / amax and amax / 127 correctly rounded to float32 (through float64, as the native
    # kernels do); torch's float32 scalar / tensor is a reciprocal then a product.
    amax = xf.abs().amax(dim=-1).double()
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax)).float()
    q = torch.round(xf * inv[..., None]).clamp_(-127, 127).to(torch.int8)
    return q, (amax / 127.0).float()


def int8_linear(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [..., in] -> [..., out] in out_dtype (default x.dtype)."""
    out_dtype = out_dtype or x.dtype
    if weight.silu_gated:  # not the MLP's own path (int8_linear_silu): the plain GEMM, rows reordered back
        bias = silu_gated_order(bias, TILE_COLS) if bias is not None else None
        out = _packed_linear(x.reshape(-1, x.shape[-1]), weight, bias, out_dtype)
        return gate_up_order(out, TILE_COLS).reshape(*x.shape[:-1], weight.out_features)
    gemm = weight.gemm
    if (gemm is not None and x.dim() == 2 and x.stride(1) == 1 and x.dtype in _NATIVE_DTYPES
            and out_dtype in _NATIVE_DTYPES and (bias is None or (bias.dtype == out_dtype and bias.is_contiguous()))):
        return gemm(x, bias, out_dtype)  # the decode hot path: checks above, nothing else in Python
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if weight.packed is not None:
        out = _packed_linear(x2, weight, bias, out_dtype)
    else:
        out = _torch_linear(x2, weight, bias, out_dtype)
    return out.reshape(*lead, weight.out_features)


def int8_linear_silu(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """silu(gate) * up of a silu-gated gate_up weight: x [..., in] -> [..., out / 2] in x.dtype,
    bias in the [gate | up] order of the float weight."""
    if bias is not None:
        bias = silu_gated_order(bias.to(x.dtype), TILE_COLS)
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if weight.gemm is not None and x2.stride(1) == 1 and x2.dtype in _NATIVE_DTYPES:
        out = weight.gemm(x2, bias, x2.dtype)
    else:
        out = _packed_linear(x2, weight, bias, x.dtype, silu=True)
    return out.reshape(*lead, weight.out_features // 2)


def _torch_linear(x2: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None,
                  out_dtype: torch.dtype) -> torch.Tensor:
    q, scale = quantize_activations(x2)
    m, k = x2.shape
    xq = (q.view(m, -1, GROUP).float() * scale[..., None]).view(m, -1)[:, :k]
    out = (xq @ weight.qweight.float().t()) * weight.scale[:weight.out_features]
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def _packed_linear(x2: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None,
                   out_dtype: torch.dtype, silu: bool = False) -> torch.Tensor:
    # The kernel takes float32/bf16 rows in and out; anything else (float16) goes through float32.
    kernel_out = out_dtype if out_dtype in _NATIVE_DTYPES else torch.float32
    if x2.dtype not in _NATIVE_DTYPES:
        x2 = x2.float()
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if bias is not None and bias.dtype != kernel_out:
        bias = bias.to(kernel_out)
    out = ops.int8_linear(x2, weight.packed, weight.comp, weight.scale, weight.out_features, bias, kernel_out,
                          silu=silu)
    if out is None:
        raise RuntimeError("native int8 kernel refused a packed weight it reported as supported")
    return out if out.dtype == out_dtype else out.to(out_dtype)
