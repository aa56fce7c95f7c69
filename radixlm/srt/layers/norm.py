"""RMSNorm with the Hugging Face Llama numerics (normalise in float32, scale in model dtype)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        # torch.empty: the loader overwrites every parameter, so no init work is wasted.
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype), requires_grad=False)
        self.eps = eps
        self.hidden_size = hidden_size

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """With `residual`, computes norm(x + residual) and also returns the new residual
        (x + residual): fusing the add saves one pass over the activations per layer."""
        if residual is not None:
            x = x + residual
            residual = x
        # One kernel in every dtype. In float32 this is HF's maths exactly. In bf16/fp16 torch
        # accumulates in float32 and rounds once at the end, where HF rounds the normalised
        # value before the weight multiply: at most one bf16 ulp apart, and 4 fewer ops
        # (two dtype casts, a mul, their allocations) per norm, 60 norms per forward.
        out = F.rms_norm(x, (self.hidden_size,), self.weight, self.eps)
        return out if residual is None else (out, residual)
