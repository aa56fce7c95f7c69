"""How many drafts a row should verify this step: drafting backs off when acceptance is low or
when extra verified tokens cost more than they save (large batches).

Model: each draft token is accepted with probability a once the ones before it were (what
rejection makes of a draft: the first rejection ends the run). A draft of k tokens then emits
E(k) = 1 + a + ... + a^k tokens in one step, and costs cost(k) decode steps. The cost is either
a number c, read as cost(k) = 1 + c k (c: one more verified token relative to a whole decode
step, small for a memory-bound single stream, near 1 once the batch is compute-bound), or the
sequence cost(0..max_k) itself, as measured on this machine (step_cost.py). The row drafts the
k in [0, max_k] that maximises E(k) / cost(k).

`AcceptanceTracker` estimates a per request from its own steps: n accepted of k drafted is n
successes and, if n < k, one failure (the maximum-likelihood estimate of a for such runs).
Counts decay every step, drafted or not, towards a prior, so a request that stopped drafting
after a bad stretch probes again later rather than never. The tracker is a plain value the
integration keeps on the request (it dies with it: nothing to free on the stop path).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# A draft's cost: c of cost(k) = 1 + c k, or cost(0..max_k) (cost(0) = 1).
DraftCost = float | Sequence[float]

__all__ = ["AcceptanceTracker", "AdaptiveConfig", "DraftCost", "best_draft_length", "expected_emitted"]


@dataclass(frozen=True)
class AdaptiveConfig:
    # Drafts from a shorter suffix match are dropped: the benchmark measures 4-21% acceptance
    # for 1-token matches on most workloads, against 83-99% for 5+ tokens on repeating text.
    min_match_length: int = 2
    # Prior per-token acceptance and its weight in pseudo-trials.
    prior: float = 0.5
    prior_weight: float = 2.0
    # Per-step decay of the observed counts (0.9: roughly the last ten steps matter).
    decay: float = 0.9

    def __post_init__(self) -> None:
        if self.min_match_length < 1:
            raise ValueError(f"min_match_length must be >= 1, got {self.min_match_length}")
        if not 0.0 <= self.prior <= 1.0 or self.prior_weight <= 0.0:
            raise ValueError(f"need 0 <= prior <= 1 and prior_weight > 0, got {self.prior}, {self.prior_weight}")
        if not 0.0 < self.decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {self.decay}")


def expected_emitted(a: float, k: int) -> float:
    """Tokens a k-token draft emits in expectation (the target's own token included)."""
    return float(sum(a ** i for i in range(k + 1)))


def best_draft_length(a: float, cost: DraftCost, max_k: int) -> int:
    """The k in [0, max_k] maximising expected tokens per unit of step cost (ties: shorter).
    A cost sequence shorter than max_k + 1 caps k at its last index."""
    if isinstance(cost, (int, float)):
        cost = [1.0 + cost * k for k in range(max_k + 1)]
    max_k = min(max_k, len(cost) - 1)
    if max_k <= 0 or a <= 0.0:
        return 0
    best_k, best = 0, 1.0
    for k in range(1, max_k + 1):
        gain = expected_emitted(a, k) / cost[k]
        if gain > best + 1e-12:
            best_k, best = k, gain
    return best_k


@dataclass
class AcceptanceTracker:
    """One request's decayed accepted / trial counts (see the module docstring)."""

    accepted: float = 0.0
    trials: float = 0.0

    def estimate(self, cfg: AdaptiveConfig) -> float:
        return (self.accepted + cfg.prior * cfg.prior_weight) / (self.trials + cfg.prior_weight)

    def observe(self, drafted: int, accepted: int, cfg: AdaptiveConfig) -> None:
        """After a verify step (drafted may be 0: the counts still decay)."""
        if not 0 <= accepted <= drafted:
            raise ValueError(f"accepted {accepted} of {drafted} drafted")
        self.accepted = self.accepted * cfg.decay + accepted
        self.trials = self.trials * cfg.decay + accepted + (1 if accepted < drafted else 0)

    def may_draft(self, max_k: int, cost: DraftCost, cfg: AdaptiveConfig) -> bool:
        """Whether any draft of at most max_k tokens could get a non-zero draft_length now; when
        not, the caller need not look one up (draft_length would be 0 for every match)."""
        return best_draft_length(self.estimate(cfg), cost, max_k) > 0

    def draft_length(self, match_length: int, max_k: int, cost: DraftCost, cfg: AdaptiveConfig) -> int:
        """How many of a proposed draft (from a match of match_length tokens) to verify."""
        if match_length < cfg.min_match_length:
            return 0
        return best_draft_length(self.estimate(cfg), cost, max_k)
