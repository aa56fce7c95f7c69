"""Rotary position embedding, Hugging Face "rotate_half" layout.

Each head's vector is split into halves (x1, x2) that rotate together:
    out = [x1*cos - x2*sin, x2*cos + x1*sin]
cos/sin are cached per position, so a flat batch of tokens with arbitrary positions
(prefill chunks, decode of many requests) is one gather.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from radixlm.kernels.cpu import ops as cpu_ops
from radixlm.srt.layers.rope_scaling import RopeAngles, compute_inv_freq, default_inv_freq, llama3_inv_freq

__all__ = ["RotaryEmbedding", "BatchRope", "apply_rotary", "apply_rotary_full", "full_width_tables",
           "compute_inv_freq", "default_inv_freq", "llama3_inv_freq"]


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, base: float,
                 rope_scaling: dict | None = None, rotary_dim: int | None = None) -> None:
        """`rotary_dim` < head_dim (partial rotary): only each head's first rotary_dim
        dimensions rotate, the rest pass through; `rope_scaling` as in rope_scaling.py."""
        super().__init__()
        self.rotary_dim = rotary_dim or head_dim
        if self.rotary_dim % 2 or self.rotary_dim > head_dim:
            raise ValueError(f"rotary dimension {self.rotary_dim} must be even and at most head_dim {head_dim}")
        self.head_dim = head_dim
        self.angles = RopeAngles(self.rotary_dim, base, rope_scaling, max_position)
        self.inv_freq = self.angles.inv_freq  # float32, CPU (below the limit, for the position-dependent types)
        self.max_position = max_position
        # Built lazily on the input's device (the model is constructed without running
        # any init and may be moved); keyed by (device, dtype).
        self._cache: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def _cos_sin(self, device: torch.device, dtype: torch.dtype, needed: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        entry = self._cache.get((device, dtype))
        if entry is not None and entry[0].shape[0] >= needed:
            return entry
        n = max(self.max_position, needed)
        if n > self.max_position:  # positions past the config's limit: grow, don't crash
            self.max_position = n
            self._cache.clear()
        freqs = self.angles.angles(n)  # [n, rotary_dim/2], float32 like HF
        # Half-width tables: both halves of HF's cat(freqs, freqs) are equal. The attention
        # factor (yarn, longrope) multiplies both, as HF does before casting.
        cos, sin = freqs.cos(), freqs.sin()
        if self.angles.attention != 1.0:
            cos, sin = cos * self.angles.attention, sin * self.angles.attention
        entry = (cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype))
        self._cache[(device, dtype)] = entry
        return entry

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype, max_seq_len: int | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token tables [T, 1, D/2], gathered once per forward and shared by all layers.

        max_seq_len (an upper bound of positions + 1, known on the host from the batch)
        avoids a device sync to find the largest position.
        """
        if max_seq_len is None:
            max_seq_len = int(positions.max()) + 1 if positions.numel() else 0
        cos_t, sin_t = self._cos_sin(positions.device, dtype, max_seq_len)
        return cos_t.index_select(0, positions).unsqueeze(1), sin_t.index_select(0, positions).unsqueeze(1)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, head_dim] -> rotated copy (convenience; the model uses apply_rotary)."""
        cos, sin = self.cos_sin(positions, x.dtype)
        if self.rotary_dim == x.shape[-1]:
            return apply_rotary(x, cos, sin)
        return torch.cat((apply_rotary(x[..., :self.rotary_dim], cos, sin), x[..., self.rotary_dim:]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D]; cos/sin: [T, 1, D/2]. q and k may be concatenated along heads."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def full_width_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Half tables [T, 1, D/2] -> (cat(cos, cos), cat(-sin, sin)), each [T, 1, D].

    Built once per forward; they let apply_rotary_full rotate with a roll and two
    multiplies instead of slicing both halves (half the kernel launches per layer)."""
    return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)


def apply_rotary_full(x: torch.Tensor, cos_full: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Same result as apply_rotary, bit for bit (each product is rounded as in HF's
    q*cos + rotate_half(q)*sin, since -x2*sin == x2*(-sin)): roll(x) is cat(x2, x1)."""
    out = x * cos_full
    rolled = x.roll(x.shape[-1] // 2, dims=-1)
    return out.add_(rolled.mul_(sin_signed))


@dataclass
class BatchRope:
    """The rotary tables of one forward, built once and used by every layer.

    On CPU with the native kernels: float32 half tables indexed by position inside the
    kernel (rotation in place, one pass, no per-token tables); otherwise the gathered
    full-width tables of apply_rotary_full."""
    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    native: bool
    rotary_dim: int  # < head_dim: partial rotary (the native kernels then never see it)

    @staticmethod
    def build(rotary: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype,
              max_seq_len: int | None) -> "BatchRope":
        if positions.device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and cpu_ops.available():
            if max_seq_len is None:
                max_seq_len = int(positions.max()) + 1 if positions.numel() else 0
            cos, sin = rotary._cos_sin(positions.device, torch.float32, max_seq_len)
            return BatchRope(positions.contiguous(), cos, sin, True, rotary.rotary_dim)
        cos, sin = full_width_tables(*rotary.cos_sin(positions, dtype, max_seq_len))
        return BatchRope(positions, cos, sin, False, rotary.rotary_dim)

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, D] -> rotated x (in place when native and the whole head rotates)."""
        partial = self.rotary_dim != x.shape[-1]
        part = x[..., :self.rotary_dim] if partial else x
        if not partial and self.native and cpu_ops.rope_inplace(x, self.positions, self.cos, self.sin):
            return x
        if self.native:  # layout the kernel does not take: torch tables on the fly
            cos, sin = full_width_tables(self.cos.index_select(0, self.positions).unsqueeze(1).to(x.dtype),
                                         self.sin.index_select(0, self.positions).unsqueeze(1).to(x.dtype))
        else:
            cos, sin = self.cos, self.sin
        rotated = apply_rotary_full(part, cos, sin)
        return torch.cat((rotated, x[..., self.rotary_dim:]), dim=-1) if partial else rotated
