"""RMSNorm with the Hugging Face Llama numerics (normalise in float32, scale in model dtype)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixlm.kernels.cpu import ops as cpu_ops


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        # torch.empty: the loader overwrites every parameter, so no init work is wasted.
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype), requires_grad=False)
        self.eps = eps
        self.hidden_size = hidden_size
        self._native: bool | None = None  # native CPU kernel usable (decided on first call)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """With `residual`, computes norm(x + residual) and also returns the new residual
        (x + residual): fusing the add saves one pass over the activations per layer.
        The native CPU kernel updates `residual` in place (the caller's residual stream is
        never shared) and does add + norm + scale in one pass (torch's bf16 rms_norm is
        ~100 us for a [32, 576] batch, 5 ops with the add)."""
        if self._native is None:
            self._native = cpu_ops.supports(self.weight)
        if self._native and x.dim() == 2 and x.dtype == self.weight.dtype:
            out = cpu_ops.add_rmsnorm(x, residual, self.weight, self.eps)
            if out is not None:
                return out if residual is None else (out, residual)
        if residual is not None:
            x = x + residual
            residual = x
        # One kernel in every dtype. In float32 this is HF's maths exactly. In bf16/fp16 torch
        # accumulates in float32 and rounds once at the end, where HF rounds the normalised
        # value before the weight multiply: at most one bf16 ulp apart, and 4 fewer ops
        # (two dtype casts, a mul, their allocations) per norm, 60 norms per forward.
        out = F.rms_norm(x, (self.hidden_size,), self.weight, self.eps)
        return out if residual is None else (out, residual)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the checkpoint stores w and the scale is (1 + w), applied in float32
    before the result is rounded to the model dtype (Hugging Face's Gemma numerics)."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            x = x + residual
            residual = x
        scale = 1.0 + self.weight.float()
        if x.dtype == torch.float32:
            out = cpu_ops.add_rmsnorm(x, None, scale, self.eps) if x.dim() == 2 and cpu_ops.supports(x) else None
            if out is None:
                out = F.rms_norm(x, (self.hidden_size,), scale, self.eps)
        else:
            out = F.rms_norm(x.float(), (self.hidden_size,), scale, self.eps).to(x.dtype)
        return out if residual is None else (out, residual)
