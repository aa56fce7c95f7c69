"""Inference-only Linear/Embedding whose parameters start uninitialised.

torch.nn.Linear runs kaiming init on construction (~1 s for a 135M model on CPU) only
for the loader to overwrite it; these allocate with torch.empty instead.

On CPUs with AVX512-BF16, a bfloat16 Linear keeps a copy of its weight packed for radixlm's
own AVX512-BF16 GEMM (bf16_gemm.py; on Zen 4, 2 cores, SmolLM2 shapes with the weights
streaming from DRAM: 1.1-1.4x oneDNN's prepacked matmul at batch 1 and 32). With
RADIXLM_BF16_GEMM=0 (or an odd in_features) it keeps one in oneDNN's blocked layout
("prepacked") instead: F.linear re-blocks the weight on every call, and measured here the
prepacked matmul is 1.3-1.5x faster at every batch size from 1 to 128 with bit-identical output.
The packed copy is derived state: it is built lazily on the first forward and dropped
by `invalidate_packed()` whenever the weight may have been written (the model calls it
for every parameter the loader or the weight updater addresses by name). A Linear with
`quantization` set multiplies through an int8 copy instead (int8_linear.py), derived and
invalidated the same way. A float32 Linear on any AVX2 CPU, and a bfloat16 one on CPUs
without a fast bf16 path (AVX2 only, e.g. AMD Zen 3), multiplies through radixlm's own AVX2
GEMM over a panel-packed copy instead (float_gemm.py): its rows do not depend on the batch
size (torch's float32 GEMM's do, on AVX-512), and where bf16 is emulated it is far faster.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import radixlm.envs as envs
from radixlm.srt.layers import bf16_gemm, float_gemm
from radixlm.srt.layers.int8_linear import Int8Weight, int8_linear, quantize_weight


def mkldnn_pack_supported(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether prepacked oneDNN linear is usable (and worth it) for this dtype/device."""
    if not envs.mkldnn_pack_enabled():
        return False
    if dtype != torch.bfloat16 or torch.device(device).type != "cpu":
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    from radixlm.srt.weights.loader import cpu_has_fast_bf16
    return cpu_has_fast_bf16() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN-blocked copy of a [out, in] weight. Created outside inference mode so that
    the packed tensor is a normal tensor usable from any grad mode."""
    with torch.inference_mode(False), torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().clone(), 32)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


Packed = torch.Tensor | float_gemm.PackedFloatWeight | bf16_gemm.PackedBf16Weight  # oneDNN-blocked or radixlm panels


def pack_for(weight: torch.Tensor, silu_gated: bool = False) -> Packed | None:
    """The packed copy a float weight is multiplied through on this CPU, or None (F.linear).
    silu_gated: a gated MLP's [gate; up] (Linear(silu_gated=True))."""
    if bf16_gemm.wanted(weight.dtype, weight.device, weight.shape[1]):
        return bf16_gemm.pack_weight(weight, silu_gated)
    if mkldnn_pack_supported(weight.dtype, weight.device):
        return pack_weight(weight)
    if float_gemm.wanted(weight.dtype, weight.device):
        return float_gemm.pack_weight(weight)
    return None


def linear_packed(x: torch.Tensor, weight: torch.Tensor, packed: Packed | None,
                  bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias) through `packed` (from pack_for(weight)) when it takes x."""
    if isinstance(packed, float_gemm.PackedFloatWeight):
        out = float_gemm.linear(x, packed, bias)
        if out is not None:
            return out
    elif isinstance(packed, bf16_gemm.PackedBf16Weight):
        out = bf16_gemm.linear(x, packed, bias)
        if out is not None:
            return out
    elif packed is not None and x.dtype == weight.dtype:
        return packed_linear(x, packed, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Module):
    # Bumped whenever any Linear drops its derived copies: whoever caches pointers into them
    # (models/fused_decode.py) rebuilds when it changes.
    generation = 0

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 dtype: torch.dtype | None = None, silu_gated: bool = False) -> None:
        """silu_gated: the weight is a gated MLP's [gate; up], whose int8 or bf16-panel copy is
        packed for SiLU * mul in the GEMM's epilogue (GatedMLP); forward still returns [gate | up]."""
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.silu_gated = silu_gated
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
                     if bias else None)
        self._packed: Packed | None = None
        self._pack_ok: bool | None = None  # decided on the first forward (device/dtype known)
        self.quantization: str | None = None  # "w8a8_int8": multiply through self._int8
        self._int8: Int8Weight | None = None

    def invalidate_packed(self) -> None:
        """Drop every copy derived from the weight (packed, quantized)."""
        self._packed = None
        self._pack_ok = None
        self._int8 = None
        Linear.generation += 1

    def packed_weight(self) -> Packed | None:
        """The packed copy of the float weight this Linear multiplies through (built on first
        use), or None where it calls F.linear."""
        if self._pack_ok is None:
            self._packed = pack_for(self.weight, self.silu_gated)
            self._pack_ok = self._packed is not None
        return self._packed

    def int8_weight(self) -> Int8Weight:
        """The int8 copy of the weight, built if missing."""
        if self._int8 is None:
            self._int8 = quantize_weight(self.weight, silu_gated=self.silu_gated)
        return self._int8

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantization is not None:
            return int8_linear(x, self.int8_weight(), self.bias)
        return linear_packed(x, self.weight, self.packed_weight(), self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, dtype=dtype), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)
