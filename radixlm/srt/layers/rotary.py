"""Rotary position embedding, Hugging Face "rotate_half" layout.

Each head's vector is split into halves (x1, x2) that rotate together:
    out = [x1*cos - x2*sin, x2*cos + x1*sin]
cos/sin are cached per position, so a flat batch of tokens with arbitrary positions
(prefill chunks, decode of many requests) is one gather.
"""
from __future__ import annotations

import math

from dataclasses import dataclass

import torch
from torch import nn

from radixlm.kernels.cpu import ops as cpu_ops


def default_inv_freq(head_dim: int, base: float) -> torch.Tensor:
    # Same expression as HF (int64 arange -> float) so float32 results are bit-identical.
    # Explicit CPU: models are built under a `torch.device` context, and the tables are
    # computed on CPU then moved (see RotaryEmbedding._cos_sin).
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1 long-context scaling: long wavelengths are slowed by `factor`, short ones
    kept, and the band in between interpolated smoothly."""
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    orig = float(scaling.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv_freq
    low_wavelen, high_wavelen = orig / low, orig / high
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (orig / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(in_band, blended, scaled)


def compute_inv_freq(head_dim: int, base: float, rope_scaling: dict | None) -> torch.Tensor:
    inv_freq = default_inv_freq(head_dim, base)
    if not rope_scaling:
        return inv_freq
    kind = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        # Positions divided by factor == frequencies divided by factor.
        return inv_freq / float(rope_scaling["factor"])
    if kind == "llama3":
        return llama3_inv_freq(inv_freq, rope_scaling)
    raise NotImplementedError(f"rope scaling type {kind!r} is not supported (default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, base: float,
                 rope_scaling: dict | None = None) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError("rotary head_dim must be even")
        self.head_dim = head_dim
        self.inv_freq = compute_inv_freq(head_dim, base, rope_scaling)  # float32, CPU
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
        t = torch.arange(n, dtype=torch.int64, device="cpu").float()
        freqs = torch.outer(t, self.inv_freq)  # [n, D/2], float32 like HF
        # Half-width tables: both halves of HF's cat(freqs, freqs) are equal.
        entry = (freqs.cos().to(device=device, dtype=dtype), freqs.sin().to(device=device, dtype=dtype))
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
        return apply_rotary(x, cos, sin)


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

    @staticmethod
    def build(rotary: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype,
              max_seq_len: int | None) -> "BatchRope":
        if positions.device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and cpu_ops.available():
            if max_seq_len is None:
                max_seq_len = int(positions.max()) + 1 if positions.numel() else 0
            cos, sin = rotary._cos_sin(positions.device, torch.float32, max_seq_len)
            return BatchRope(positions.contiguous(), cos, sin, True)
        cos, sin = full_width_tables(*rotary.cos_sin(positions, dtype, max_seq_len))
        return BatchRope(positions, cos, sin, False)

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, D] -> rotated x (in place when native)."""
        if self.native and cpu_ops.rope_inplace(x, self.positions, self.cos, self.sin):
            return x
        if self.native:  # layout the kernel does not take: torch tables on the fly
            cos, sin = full_width_tables(self.cos.index_select(0, self.positions).unsqueeze(1).to(x.dtype),
                                         self.sin.index_select(0, self.positions).unsqueeze(1).to(x.dtype))
            return apply_rotary_full(x, cos, sin)
        return apply_rotary_full(x, self.cos, self.sin)
