"""In-place weight updates and reads by Hugging Face parameter name (the RL API).

An update is all or nothing: every (name, tensor) is resolved and checked before the first
copy, so a bad name, shape or dtype leaves the model exactly as it was.
"""
from __future__ import annotations

from typing import Iterable

import torch


class WeightUpdater:
    def __init__(self, model) -> None:
        self.model = model
        self.params = dict(model.named_parameters())

    def target(self, name: str) -> torch.Tensor | None:
        """The parameter slice a Hugging Face tensor name maps to (None: ignored name)."""
        resolved = self.model._param_target(name)
        if resolved is None:
            return None
        pname, off, rows = resolved
        param = self.params.get(pname)
        if param is None:
            raise ValueError(f"unknown weight name {name!r}")
        return param.data if rows < 0 else param.data.narrow(0, off, rows)

    def update(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy the tensors into the model; returns how many were applied."""
        plan: list[tuple[torch.Tensor, torch.Tensor]] = []
        for name, tensor in named_tensors:
            if not isinstance(tensor, torch.Tensor):
                raise ValueError(f"weight {name!r} is not a tensor")
            if not tensor.is_floating_point():
                raise ValueError(f"weight {name!r} has dtype {tensor.dtype}; a floating-point dtype is required")
            dest = self.target(name)
            if dest is None:
                continue
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ValueError(f"shape mismatch for {name!r}: got {tuple(tensor.shape)}, "
                                 f"the model has {tuple(dest.shape)}")
            if not torch.isfinite(tensor).all():
                raise ValueError(f"weight {name!r} contains NaN or infinite values")
            plan.append((dest, tensor))
        with torch.no_grad():
            for dest, tensor in plan:
                dest.copy_(tensor)
        return len(plan)

    def get(self, name: str, truncate_size: int = 100, max_elements: int | None = None) -> list:
        """The first `truncate_size` rows of the parameter (as SGLang returns them); a
        ValueError instead when that is more than `max_elements` numbers."""
        if not isinstance(truncate_size, int) or truncate_size < 1:
            raise ValueError(f"truncate_size must be a positive integer, got {truncate_size!r}")
        if name == "lm_head.weight" and self.model.lm_head is None:
            name = "model.embed_tokens.weight"  # tied: the head is the embedding
        dest = self.target(name)
        if dest is None:
            raise ValueError(f"weight {name!r} is not stored by the model")
        part = dest[:truncate_size]
        if max_elements is not None and part.numel() > max_elements:
            raise ValueError(f"{name} truncated to {truncate_size} rows has {part.numel()} elements, more than "
                             f"{max_elements} (server flag --max-weights-response-elements); ask for fewer rows")
        return part.float().tolist()
