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
        if x.dtype == torch.float32:
            # One fused kernel; identical maths to HF in float32.
            out = F.rms_norm(x, (self.hidden_size,), self.weight, self.eps)
        else:
            # HF casts back to the model dtype *before* multiplying by the weight.
            out = F.rms_norm(x.float(), (self.hidden_size,), None, self.eps).to(x.dtype) * self.weight
        return out if residual is None else (out, residual)
