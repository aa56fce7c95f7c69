"""Decode under KV pressure: the new-token-ratio tracker and the choice of retraction victims.

Constants and formulas are semantics §4.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from radixlm.core import Req
from radixlm.registry import Registry

logger = logging.getLogger(__name__)

# Tokens of decode headroom that each remaining request should have after a retraction.
RETRACT_DECODE_STEPS = 20
INIT_RATIO_BASE = 0.7
MIN_RATIO_FACTOR = 0.14
RATIO_DECAY_STEPS = 600


@dataclass
class NewTokenRatioTracker:
    """How much of their remaining max_new_tokens running requests are expected to use.

    Starts conservative, decays while decode goes well, jumps up after a retraction."""
    conservativeness: float = 1.0

    def __post_init__(self) -> None:
        self.init = min(INIT_RATIO_BASE * self.conservativeness, 1.0)
        self.floor = self.init * MIN_RATIO_FACTOR
        self.step_size = (self.init - self.floor) / RATIO_DECAY_STEPS
        self.value = self.init

    def on_decode_step(self) -> None:
        self.value = max(self.value - self.step_size, self.floor)

    def on_idle(self) -> None:
        self.value = self.init

    def on_retract(self, remaining: list[Req]) -> None:
        out = sum(len(r.output_ids) for r in remaining)
        total_max = sum(r.sampling_params.max_new_tokens for r in remaining)
        self.value = min(1.0, (out + RETRACT_DECODE_STEPS * len(remaining)) / (total_max + 1))


# Sort keys by name: the *smallest* key is retracted first.
RETRACTION_POLICIES: Registry[Callable[[Req], tuple[int, ...]]] = Registry("retraction policy")


@RETRACTION_POLICIES.register("length")
def _least_progress(r: Req) -> tuple[int, ...]:
    """Fewest output tokens first (least work lost); ties: the longest prompt (most KV back)."""
    return (len(r.output_ids), -len(r.origin_input_ids))


@RETRACTION_POLICIES.register("priority")
def _lowest_priority(r: Req) -> tuple[int, ...]:
    """Lowest priority first; among equals, the least progress."""
    return (r.priority, len(r.output_ids), -len(r.origin_input_ids))


def retraction_order(reqs: list[Req], policy: str = "length") -> list[Req]:
    """Requests sorted so that the *last* element is the first victim: the lowest priority
    rank first (all ranks are 0 without priority scheduling), then the policy's order."""
    key = RETRACTION_POLICIES.get(policy)
    return sorted(reqs, key=lambda r: (r.priority, *key(r)), reverse=True)
