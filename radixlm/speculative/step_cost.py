"""What a verify step costs against a plain decode step, measured on this machine and dtype.

The adaptive rule (adaptive.py) picks the draft length k that maximises E(k) / cost(k), where
cost(k) is the time of a step whose B rows verify k drafts each, relative to a decode step of
the same B rows. Without a measurement the scheduler assumes cost(k) = 1 + c(B) k with c(B) a
line fitted on whole steps on one machine in float32. It underprices some: on an AVX2-only CPU a w8a8
batch-1 step turns compute-bound after the first few rows (the int8 micro-tile covers 4 rows per
pass over the weights) and nine rows cost 1.75 decode steps, where the line says 1.56.

`StepCost` holds forward times of one row extending T tokens, T at a few points (measured once
at start-up by srt/model_runner/step_timing.py), and answers cost(k) for a batch of B rows as
t(B (1 + k)) / t(B): the linears see B (1 + k) rows either way. What each row adds beside them
(its own attention, verification, the lookup) is not in it, so the scheduler never prices a
step below the line either (scheduler/speculation.py `_cost`).
"""
from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

__all__ = ["StepCost", "linear_cost_ratios", "priced_ratios"]


def linear_cost_ratios(extra_token_cost: float, max_k: int) -> tuple[float, ...]:
    """cost(k) = 1 + c k for k = 0..max_k (the unmeasured model)."""
    return tuple(1.0 + extra_token_cost * k for k in range(max_k + 1))


def priced_ratios(measured: StepCost, extra_token_cost: float, batch_size: int, max_k: int) -> tuple[float, ...]:
    """cost(0..max_k) as the scheduler prices a step: the larger of the measured forward ratio
    and the line. The measurement (one row's forward) leaves out what each row adds beside the
    linears; in float32 at batch 32 it priced a draft token at 0.41 of a step, drafting rose and
    chat throughput fell 18 %, where the line (fitted on whole steps) lost nothing. Where the
    forward alone costs more than the line, the measurement decides."""
    line = linear_cost_ratios(extra_token_cost, max_k)
    return tuple(max(m, ln) for m, ln in zip(measured.ratios(batch_size, max_k), line))


@dataclass
class StepCost:
    """Measured forward seconds at increasing token counts (at least two points, the first 1)."""

    tokens: tuple[int, ...]
    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.seconds) or len(self.tokens) < 2:
            raise ValueError(f"need two or more (tokens, seconds) points, got {self.tokens}, {self.seconds}")
        if self.tokens[0] != 1 or any(b <= a for a, b in zip(self.tokens, self.tokens[1:])):
            raise ValueError(f"token counts must start at 1 and increase, got {self.tokens}")
        if any(s <= 0.0 for s in self.seconds):
            raise ValueError(f"times must be positive, got {self.seconds}")
        # A forward of more tokens never takes less time: a measured dip is noise.
        fixed = list(self.seconds)
        for i in range(1, len(fixed)):
            fixed[i] = max(fixed[i], fixed[i - 1])
        self.seconds = tuple(fixed)

    def time(self, n: int) -> float:
        """Seconds for n tokens: piecewise linear between the points, the last segment's slope
        beyond the last one."""
        if n <= 1:
            return self.seconds[0]
        i = bisect_left(self.tokens, n)
        if i < len(self.tokens) and self.tokens[i] == n:
            return self.seconds[i]
        i = min(max(i, 1), len(self.tokens) - 1)
        t0, t1 = self.tokens[i - 1], self.tokens[i]
        s0, s1 = self.seconds[i - 1], self.seconds[i]
        return s0 + (s1 - s0) * (n - t0) / (t1 - t0)

    def ratios(self, batch_size: int, max_k: int) -> tuple[float, ...]:
        """cost(k) for k = 0..max_k at this batch size (cost(0) = 1)."""
        b = max(batch_size, 1)
        base = self.time(b)
        return tuple(self.time(b * (1 + k)) / base for k in range(max_k + 1))

    def as_dict(self) -> dict[str, list[float]]:
        return {"tokens": list(self.tokens), "ms": [round(1e3 * s, 3) for s in self.seconds]}
