"""Adaptive draft length: the cost model's choice, the acceptance estimate, and the probe."""
from __future__ import annotations

import random

import pytest

from radixlm.speculative.adaptive import (
    AcceptanceTracker,
    AdaptiveConfig,
    best_draft_length,
    expected_emitted,
)

CFG = AdaptiveConfig()
C = 0.3


def test_expected_emitted():
    assert expected_emitted(0.0, 5) == 1.0
    assert expected_emitted(1.0, 5) == 6.0
    assert expected_emitted(0.5, 2) == pytest.approx(1.75)


def test_best_draft_length_follows_acceptance_and_cost():
    assert best_draft_length(0.0, 0.05, 8) == 0
    assert best_draft_length(0.9, 0.05, 0) == 0
    assert best_draft_length(1.0, 0.05, 8) == 8  # every draft accepted: draft all
    assert best_draft_length(0.99, 2.0, 8) == 0  # a verified token costs more than a step
    # Monotone: more acceptance never drafts less, more cost never drafts more.
    ks = [best_draft_length(a / 20, 0.1, 12) for a in range(21)]
    assert ks == sorted(ks) and ks[0] == 0 and ks[-1] == 12
    ks = [best_draft_length(0.8, c / 10, 12) for c in range(11)]
    assert ks == sorted(ks, reverse=True)
    # Brute force over k agrees.
    for a in (0.3, 0.6, 0.85):
        for c in (0.02, 0.2, 0.5):
            gains = [expected_emitted(a, k) / (1 + c * k) for k in range(9)]
            assert best_draft_length(a, c, 8) == gains.index(max(gains))


def test_tracker_estimates_the_per_token_acceptance():
    rng = random.Random(0)
    for a in (0.2, 0.5, 0.9):
        t = AcceptanceTracker()
        cfg = AdaptiveConfig(decay=1.0)  # no decay: the plain estimate
        for _ in range(3000):
            k = rng.randrange(1, 9)
            n = 0
            while n < k and rng.random() < a:
                n += 1
            t.observe(k, n, cfg)
        assert t.estimate(cfg) == pytest.approx(a, abs=0.03)


def test_back_off_then_probe_again():
    t = AcceptanceTracker()
    # One verified token costs 0.3 steps: a draft pays once the per-token acceptance tops 0.3.
    assert t.draft_length(4, 8, C, CFG) > 0  # the prior drafts
    for _ in range(10):
        t.observe(4, 0, CFG)  # every draft rejected
    assert t.draft_length(4, 8, C, CFG) == 0
    steps = 0
    while t.draft_length(4, 8, C, CFG) == 0:
        t.observe(0, 0, CFG)  # steps without drafts: the counts decay towards the prior
        steps += 1
    assert 1 <= steps <= 40
    for _ in range(20):
        t.observe(8, 8, CFG)  # everything accepted again: back to the longest drafts
    assert t.draft_length(4, 8, C, CFG) == 8


def test_short_matches_are_dropped_and_validation():
    t = AcceptanceTracker()
    assert t.draft_length(1, 8, 0.01, CFG) == 0
    assert t.draft_length(1, 8, 0.01, AdaptiveConfig(min_match_length=1)) > 0
    with pytest.raises(ValueError):
        t.observe(2, 3, CFG)
    for bad in ({"min_match_length": 0}, {"prior": 1.5}, {"prior_weight": 0.0}, {"decay": 0.0}):
        with pytest.raises(ValueError):
            AdaptiveConfig(**bad)


def test_may_draft_is_false_exactly_when_no_match_could_draft():
    """The scheduler skips the n-gram lookup when may_draft is False: that must never drop a
    draft draft_length would have kept, and must say True whenever one could be kept."""
    rng = random.Random(3)
    for _ in range(500):
        trials = rng.uniform(0, 30)
        t = AcceptanceTracker(accepted=rng.uniform(0, trials), trials=trials)
        cost, cap = rng.choice([0.05, 0.3, 0.7, 1.0]), rng.randrange(0, 9)
        could = any(t.draft_length(m, k, cost, CFG) > 0 for m in range(0, 13) for k in range(0, cap + 1))
        assert t.may_draft(cap, cost, CFG) == could
