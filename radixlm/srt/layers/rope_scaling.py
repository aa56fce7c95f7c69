"""Rotary frequencies per position for the rope scalings Hugging Face configs name
(`rope_scaling` / `rope_parameters`, key `rope_type` or the older `type`).

Static scalings give one inverse-frequency vector for every position:
    default   theta^(-2i/d)
    linear    the default divided by `factor` (positions stretched)
    llama3    long wavelengths divided by `factor`, short ones kept, a smooth band between
              (from a GGUF: `freq_factors`, llama.cpp's per-frequency divisors, on any of these)
    yarn      per-frequency blend of interpolation (/ factor) and extrapolation, and cos/sin
              multiplied by an attention factor (0.1 ln(factor) + 1 unless the config says)
Two scalings depend on how long the sequence is. Hugging Face recomputes them on every forward
from that forward's largest position, so a key rotated in one forward keeps its rotation in the
KV cache while later tokens use another. A prefix cache can only reuse a key whose rotation
depends on its position alone, so radixlm rotates position p as Hugging Face does when p is the
newest token of its forward (a decode step):
    dynamic   NTK: positions below max_position_embeddings the default, position p beyond it
              the base theta * (factor * (p + 1) / max - (factor - 1))^(d / (d - 2))
    longrope  per-frequency `short_factor` below original_max_position_embeddings,
              `long_factor` from there on, cos/sin multiplied by
              sqrt(1 + ln(factor) / ln(original_max_position_embeddings)) everywhere.
That is exactly Hugging Face's `generate` for a prompt shorter than the limit, however far the
generation runs past it (Llama-class models); one Hugging Face forward over a prompt longer than
the limit instead rotates all its positions with the long (dynamic: the last position's)
frequencies, and transformers' Phi-3 `generate` drops its cache when a sequence passes
original_max_position_embeddings and recomputes it all with the long factors. Matching those
would need the prefix cache keyed by which factors made a key, and a recompute at the crossing.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")
# What each type needs from the config besides the base.
_REQUIRED = {"linear": ("factor",), "llama3": ("factor",), "yarn": ("factor",), "dynamic": ("factor",),
             "longrope": ("short_factor", "long_factor")}


# Older names of the same scalings in configs on the Hub (early Phi-3 128k checkpoints).
_ALIASES = {"su": "longrope"}


def rope_type(scaling: dict | None) -> str:
    if not scaling:
        return "default"
    kind = str(scaling.get("rope_type", scaling.get("type", "default")))
    return _ALIASES.get(kind, kind)


def check_rope_scaling(scaling: dict | None, rotary_dim: int | None = None) -> None:
    """A one-line ValueError for a type radixlm does not implement or a missing parameter."""
    kind = rope_type(scaling)
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope scaling type {kind!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    missing = [k for k in _REQUIRED.get(kind, ()) if (scaling or {}).get(k) is None]
    if kind == "yarn" and "factor" in missing and (scaling or {}).get("original_max_position_embeddings"):
        missing.remove("factor")  # derived from max_position_embeddings / original (as DeepSeek configs do)
    if missing:
        raise ValueError(f"rope scaling {kind!r} lacks {', '.join(missing)}")
    if kind == "longrope" and rotary_dim is not None:
        for key in ("short_factor", "long_factor"):
            if len(scaling[key]) != rotary_dim // 2:  # type: ignore[index]
                raise ValueError(f"longrope {key} has {len(scaling[key])} entries, "  # type: ignore[index]
                                 f"the rotary dimension needs {rotary_dim // 2}")


def default_inv_freq(dim: int, base: float) -> torch.Tensor:
    # Same expression as HF (int64 arange -> float) so float32 results are bit-identical.
    # Explicit CPU: models are built under a `torch.device` context, and the tables are
    # computed on CPU then moved (see RotaryEmbedding._cos_sin).
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))


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


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_freq(dim: int, base: float, scaling: dict, max_position: int) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071): frequencies that turn fewer than `beta_slow` times over the
    original context are interpolated (divided by factor), those turning more than `beta_fast`
    times kept, a linear ramp between; plus the attention factor for cos/sin."""
    orig = int(scaling.get("original_max_position_embeddings") or max_position)
    factor = float(scaling["factor"]) if scaling.get("factor") is not None else max_position / orig
    attention = scaling.get("attention_factor")
    if attention is None:
        mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all) if mscale and mscale_all
                     else _yarn_mscale(factor))
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def dim_of(rotations: float) -> float:  # the dimension index that turns `rotations` times over orig
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").float() / dim)
    keep = 1 - ramp  # 1: extrapolate (high frequencies), 0: interpolate
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
    return inv_freq, float(attention)


def static_inv_freq(dim: int, base: float, scaling: dict | None, max_position: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies, cos/sin factor) of a scaling that is the same at every position."""
    kind = rope_type(scaling)
    inv_freq = default_inv_freq(dim, base)
    if kind == "linear":
        return inv_freq / float(scaling["factor"]), 1.0  # type: ignore[index]
    if kind == "llama3":
        return llama3_inv_freq(inv_freq, scaling), 1.0  # type: ignore[arg-type]
    if kind == "yarn":
        return yarn_inv_freq(dim, base, scaling, max_position)  # type: ignore[arg-type]
    return inv_freq, 1.0


def compute_inv_freq(head_dim: int, base: float, rope_scaling: dict | None, max_position: int = 2048) -> torch.Tensor:
    """The inverse frequencies at position 0 (for the position-dependent types: below the limit)."""
    check_rope_scaling(rope_scaling)
    return RopeAngles(head_dim, base, rope_scaling, max_position).inv_freq


@dataclass
class RopeAngles:
    """Rotation angles [n, dim/2] of positions 0..n-1 and the factor cos/sin are multiplied by."""
    dim: int  # the rotated part of a head
    base: float
    scaling: dict | None
    max_position: int  # the config's max_position_embeddings

    def __post_init__(self) -> None:
        check_rope_scaling(self.scaling, self.dim)
        self.kind = rope_type(self.scaling)
        s = self.scaling or {}
        if self.kind == "longrope":
            self.limit = int(s.get("original_max_position_embeddings") or self.max_position)
            factor = s.get("factor") or self.max_position / self.limit
            self.attention = float(s["attention_factor"]) if s.get("attention_factor") is not None else \
                1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(self.limit))
            shape = torch.arange(0, self.dim, 2, dtype=torch.int64).float() / self.dim
            self.inv_freq = 1.0 / (torch.tensor(s["short_factor"], dtype=torch.float32) * self.base ** shape)
            self.long_inv_freq = 1.0 / (torch.tensor(s["long_factor"], dtype=torch.float32) * self.base ** shape)
        elif self.kind == "dynamic":
            self.limit = self.max_position
            self.attention = 1.0
            self.inv_freq = default_inv_freq(self.dim, self.base)
        else:
            self.limit = 0  # no position dependence
            self.inv_freq, self.attention = static_inv_freq(self.dim, self.base, self.scaling, self.max_position)
            if s.get("freq_factors") is not None:
                # llama.cpp's rope_freqs tensor (GGUF): frequency i divided by factor i
                factors = torch.tensor(s["freq_factors"], dtype=torch.float32)
                if factors.numel() != self.dim // 2:
                    raise ValueError(f"rope_freqs has {factors.numel()} factors, the rotary dimension needs "
                                     f"{self.dim // 2}")
                self.inv_freq = self.inv_freq / factors

    def _dynamic_inv_freq(self, positions: torch.Tensor) -> torch.Tensor:
        """[len(positions), dim/2]: the NTK base of a forward whose last position is p, per p,
        in float32 tensor arithmetic as Hugging Face evaluates it during decoding."""
        factor = float(self.scaling["factor"])  # type: ignore[index]
        stretch = (factor * (positions + 1) / self.max_position) - (factor - 1)  # float32
        # HF's one-element tensor takes its power in double precision: so does this, per position.
        base = self.base * (stretch.double() ** (self.dim / (self.dim - 2))).float()
        exponent = torch.arange(0, self.dim, 2, dtype=torch.int64).float() / self.dim
        return 1.0 / (base[:, None] ** exponent[None, :])

    def angles(self, n: int) -> torch.Tensor:
        """float32 [n, dim/2], on the CPU: position x its inverse frequencies (as HF multiplies)."""
        t = torch.arange(n, dtype=torch.int64, device="cpu").float()
        if self.kind not in ("dynamic", "longrope") or n <= self.limit:
            return torch.outer(t, self.inv_freq)
        below = torch.outer(t[:self.limit], self.inv_freq)
        far = torch.arange(self.limit, n, dtype=torch.int64, device="cpu")
        inv = self._dynamic_inv_freq(far) if self.kind == "dynamic" else self.long_inv_freq[None, :]
        return torch.cat((below, far.float()[:, None] * inv))


def hf_rope_scaling(cfg: dict) -> tuple[dict | None, float]:
    """(the rope scaling of a config.json, None for the default; partial_rotary_factor).

    transformers >= 5 writes `rope_parameters` (theta included), older configs `rope_scaling`;
    `type` is the older name of `rope_type`. original_max_position_embeddings comes from the
    top level where a config has it there (Phi-3), else from the scaling, else
    max_position_embeddings, as transformers reads it. A scaling nested per layer type is
    returned as it is. Unsupported types raise a one-line ValueError."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling")
    partial = float(cfg.get("partial_rotary_factor") or params.get("partial_rotary_factor")
                    or (scaling or {}).get("partial_rotary_factor") or 1.0)
    if scaling is None and rope_type(params) != "default":
        scaling = params
    if not scaling or any(isinstance(v, dict) for v in scaling.values()):
        return scaling or None, partial
    scaling = {k: v for k, v in scaling.items() if k not in ("rope_theta", "partial_rotary_factor", "type")}
    scaling["rope_type"] = kind = rope_type(cfg.get("rope_scaling") or params)
    if kind == "default":
        return None, partial
    if kind in ("llama3", "yarn", "longrope"):
        top = cfg.get("original_max_position_embeddings")
        scaling["original_max_position_embeddings"] = int(top or scaling.get("original_max_position_embeddings")
                                                          or cfg.get("max_position_embeddings", 2048))
    check_rope_scaling(scaling)
    return scaling, partial
