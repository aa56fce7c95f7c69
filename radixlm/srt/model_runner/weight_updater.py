"""In-place weight updates and reads by Hugging Face parameter name (the RL API).

An update is all or nothing: every (name, tensor) is resolved and checked (`plan`) before the
first copy (`apply`), so a bad name, shape or dtype leaves the model exactly as it was. Under
tensor parallelism the caller sends full tensors; each rank keeps its shard (`hf_shard`), and
the runner agrees on the plan across ranks before any of them applies it.
"""
from __future__ import annotations

from typing import Iterable

import torch

Plan = list[tuple[torch.Tensor, torch.Tensor]]  # (parameter slice, new value)


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

    def _shard(self, name: str):
        hf_shard = getattr(self.model, "hf_shard", None)
        return hf_shard(name) if hf_shard is not None else None

    def plan(self, named_tensors: Iterable[tuple[str, torch.Tensor]], sharded: bool = False) -> Plan:
        """Check every tensor; ValueError on the first bad one. `sharded`: the tensors are this
        rank's shards already (the loader's), else full tensors cut here (fused checkpoint
        tensors, Phi-3's qkv_proj / gate_up_proj, cut into their parts first: `split_fused`)."""
        split = getattr(type(self.model), "split_fused", None)
        if split is not None and not sharded and self.model.tp.size > 1:
            named_tensors = split(named_tensors, self.model.config)
        plan: Plan = []
        for name, tensor in named_tensors:
            if not isinstance(tensor, torch.Tensor):
                raise ValueError(f"weight {name!r} is not a tensor")
            if not tensor.is_floating_point():
                raise ValueError(f"weight {name!r} has dtype {tensor.dtype}; a floating-point dtype is required")
            shard = None if sharded else self._shard(name)
            if shard is not None and not shard.held:
                continue  # another rank's part alone (a row-parallel bias lives on rank 0)
            dest = self.target(name)
            if dest is None:
                continue
            want = list(dest.shape)
            if shard is not None:
                want[shard.dim] = shard.full
            if list(tensor.shape) != want:
                raise ValueError(f"shape mismatch for {name!r}: got {tuple(tensor.shape)}, "
                                 f"the model has {tuple(want)}")
            if not torch.isfinite(tensor).all():
                raise ValueError(f"weight {name!r} contains NaN or infinite values")
            if shard is not None:  # a copy: the whole tensor (a received buffer) can be freed
                tensor = tensor.narrow(shard.dim, shard.start, shard.stop - shard.start).clone()
            plan.append((dest, tensor))
        return plan

    @staticmethod
    def apply(plan: Plan) -> int:
        with torch.no_grad():
            for dest, tensor in plan:
                dest.copy_(tensor)
        return len(plan)

    def update(self, named_tensors: Iterable[tuple[str, torch.Tensor]], sharded: bool = False) -> int:
        """Copy the tensors into the model; returns how many were applied."""
        return self.apply(self.plan(named_tensors, sharded))

    def get(self, name: str, truncate_size: int = 100, max_elements: int | None = None) -> list:
        """The first `truncate_size` rows of the parameter (as SGLang returns them); a
        ValueError instead when that is more than `max_elements` numbers."""
        _, rows = self.get_part(name, truncate_size, max_elements)
        return rows.float().tolist()

    def get_part(self, name: str, truncate_size: int = 100,
                 max_elements: int | None = None) -> tuple[object, torch.Tensor]:
        """(this rank's Shard of the tensor or None, the part of it inside the tensor's first
        `truncate_size` rows). On one rank: (None, those rows). The part is checked against
        `max_elements` before it is copied."""
        if not isinstance(truncate_size, int) or truncate_size < 1:
            raise ValueError(f"truncate_size must be a positive integer, got {truncate_size!r}")
        if name == "lm_head.weight" and self.model.lm_head is None:
            name = "model.embed_tokens.weight"  # tied: the head is the embedding
        shard = self._shard(name)
        if shard is not None and not shard.held:
            return shard, torch.empty(0)
        dest = self.target(name)
        if dest is None:
            raise ValueError(f"weight {name!r} is not stored by the model")
        if shard is not None and shard.dim == 0:
            rows = dest[:max(0, min(shard.stop, truncate_size) - shard.start)]
        else:
            rows = dest[:truncate_size]
        check_response_size(name, truncate_size, rows.numel(), max_elements)
        return shard, rows.detach().cpu().clone()


def check_response_size(name: str, truncate_size: int, numel: int, max_elements: int | None) -> None:
    """/get_weights_by_name answers at most `max_elements` numbers (a large truncate_size
    would otherwise serialize hundreds of MB)."""
    if max_elements is not None and numel > max_elements:
        raise ValueError(f"{name} truncated to {truncate_size} rows has {numel} elements, more than "
                         f"{max_elements} (server flag --max-weights-response-elements); ask for fewer rows")
