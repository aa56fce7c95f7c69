"""Inputs at the edge of the ranges: the sampler must answer with a valid token for every row
(found by fuzzing: top_p=1e-300 indexed -1; a logit_bias above float32's max sent the inverse-CDF
draw out of bounds), and never let one such row change another row's draw."""
from __future__ import annotations

import pytest
import torch

from radixlm.sampling_params import SamplingParams
from radixlm.srt.model_runner.sampler import Sampler, SamplingRow

V = 1000


def row(**kw) -> SamplingRow:
    return SamplingRow(SamplingParams(**kw), [1, 2], [])


@pytest.mark.parametrize("top_p", [1e-300, 1e-45, 1e-40, 1e-8])
@pytest.mark.parametrize("top_k", [-1, 5, 2000])
def test_tiny_top_p_keeps_the_most_likely_token(top_p, top_k):
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(1))
    out = Sampler(V).sample(logits.clone(), [row(top_p=top_p, top_k=top_k, seed=i) for i in range(3)])
    assert out.next_token_ids == logits.argmax(dim=-1).tolist()


def test_unrepresentable_logits_give_valid_tokens_and_leave_other_rows_alone():
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(2))
    bad = logits.clone()
    bad[0, 7] = float("inf")
    bad[1] = float("nan")
    bad[2] = float("-inf")
    bad[3, [3, 9]] = float("inf")
    rows = [row(seed=1), row(seed=2), row(seed=3), row(top_k=4, seed=4), row(seed=5, temperature=0.8)]
    got = Sampler(V).sample(bad, rows).next_token_ids
    assert all(0 <= t < V for t in got)
    assert got[0] == 7 and got[3] in (3, 9)
    alone = Sampler(V).sample(logits[4:].clone(), [rows[4]]).next_token_ids
    assert got[4] == alone[0]  # a seeded row draws the same next to broken rows


def test_bias_beyond_float32_set_directly_is_still_a_valid_draw():
    """Validation rejects such a bias (test_validation.py); a SamplingParams built in code
    bypasses it, and the sampler still must not crash."""
    sp = SamplingParams(temperature=0.7)
    sp.logit_bias = {5: 3.5e38}
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(3))
    got = Sampler(V).sample(logits, [SamplingRow(sp, [1], []), row(seed=9)]).next_token_ids
    assert got[0] == 5 and 0 <= got[1] < V
