"""The filter thresholds and the inverse-CDF draw, checked against plain references."""
from __future__ import annotations

import pytest
import torch

import radixlm.srt.model_runner.sampler as sampler_mod
from radixlm.sampling_params import SamplingParams
from radixlm.srt.model_runner.sampler import Sampler, SamplingRow


def ref_nucleus(x: torch.Tensor, p: float) -> set[int]:
    probs = torch.softmax(x.double(), -1)
    sp, si = probs.sort(descending=True)
    before = sp.cumsum(-1) - sp
    return set(si[before < p].tolist())


def kept(x: torch.Tensor, thr: torch.Tensor) -> list[set[int]]:
    return [set((row >= t).nonzero().squeeze(1).tolist()) for row, t in zip(x, thr)]


@pytest.mark.parametrize("prefix", [256, 16, 3])
def test_top_p_threshold_matches_full_sort_reference(prefix: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sampler_mod, "_TOP_P_PREFIX", prefix)
    torch.manual_seed(0)
    # Rows from peaked to flat, so some nuclei fit in a small prefix and some do not.
    x = torch.randn(12, 500) * torch.linspace(8.0, 0.2, 12).unsqueeze(1)
    ps = [0.05, 0.3, 0.5, 0.7, 0.9, 0.95, 0.99, 0.5, 0.9, 0.8, 0.6, 0.999]
    thr, full = sampler_mod._top_p_threshold(x, ps)
    for i, (got, p) in enumerate(zip(kept(x, thr), ps)):
        assert got == ref_nucleus(x[i], p), i
    if prefix == 3:
        assert full > 0


def test_full_sort_counted_only_when_needed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sampler_mod, "_TOP_P_PREFIX", 8)
    peaked = torch.full((1, 100), -20.0)
    peaked[0, 5] = 10.0
    flat = torch.randn(1, 100) * 0.01
    rows = [SamplingRow(SamplingParams.from_dict(dict(top_p=0.9)), [], [], frozenset()) for _ in range(2)]
    s = Sampler(100)
    assert s.sample(peaked, rows[:1]).next_token_ids == [5]
    assert s.stats.top_p_full_sort_rows == 0
    s.sample(flat, rows[1:])
    assert s.stats.top_p_full_sort_rows == 1


def test_top_k_threshold() -> None:
    x = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0], [9.0, 8.0, 7.0, 6.0, 5.0]])
    thr = sampler_mod._top_k_threshold(x, [2, 4])
    assert thr.tolist() == [4.0, 6.0]
    assert kept(x, thr) == [{1, 3}, {0, 1, 2, 3}]


def test_inverse_cdf_extremes_never_pick_filtered() -> None:
    inf = float("-inf")
    x = torch.tensor([[inf, 0.0, 1.0, inf], [inf, 0.0, 1.0, inf], [2.0, inf, inf, inf]])
    u = torch.tensor([0.0, 1.0 - 2 ** -53, 0.999999], dtype=torch.float64)
    assert sampler_mod._inverse_cdf_draw(x, u).tolist() == [1, 2, 0]
    # u = 1.0 exactly is out of U[0, 1) but still must not run past the last kept token.
    assert sampler_mod._inverse_cdf_draw(x[:1], torch.tensor([1.0], dtype=torch.float64)).tolist() == [2]
