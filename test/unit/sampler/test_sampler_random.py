"""Random sampling: filters, distributions, temperature, and seeded reproducibility."""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import radixlm.srt.model_runner.sampler as sampler_mod
from radixlm.sampling_params import SamplingParams
from radixlm.srt.model_runner.sampler import Sampler, SamplingRow, mix_seed

PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])
LOGITS = PROBS.log()
N = 20000
TOL = 0.015  # >4 sigma for N draws of any p


def row(output_ids: list[int] | None = None, **kw) -> SamplingRow:
    return SamplingRow(SamplingParams.from_dict(kw), [0, 1], list(output_ids or []), frozenset())


def freqs(logits_row: torch.Tensor, n: int = N, sampler: Sampler | None = None, **kw) -> list[float]:
    """Empirical distribution of n draws of one row (drawn as one batch of n identical rows)."""
    v = logits_row.numel()
    s = sampler or Sampler(v, seed=123)
    ids = s.sample(logits_row.expand(n, v).clone(), [row(**kw)] * n).next_token_ids
    c = Counter(ids)
    return [c[t] / n for t in range(v)]


def close(got: list[float], want: list[float]) -> bool:
    return all(abs(g - w) <= TOL for g, w in zip(got, want))


def test_plain_distribution_matches_softmax() -> None:
    assert close(freqs(LOGITS), PROBS.tolist())


def test_temperature_sharpens_and_flattens() -> None:
    for t in (0.5, 2.0):
        want = torch.softmax(LOGITS / t, -1).tolist()
        got = freqs(LOGITS, temperature=t)
        assert close(got, want), (t, got, want)
    # Sanity on direction: low temperature concentrates on the top token.
    assert freqs(LOGITS, temperature=0.5)[0] > 0.6 > 0.5 > freqs(LOGITS, temperature=2.0)[0]


@pytest.fixture(params=["top_k_list", "full_vocab"])
def top_k_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test through both ways top_k rows are drawn (_draw_top_k and _draw_full)."""
    if request.param == "full_vocab":
        monkeypatch.setattr(sampler_mod, "_SMALL_TOP_K", 0)
    return request.param


def test_top_k_renormalizes_over_k_largest(top_k_path: str) -> None:
    got = freqs(LOGITS, top_k=2)
    assert got[2] == got[3] == 0.0
    assert close(got, [0.625, 0.375, 0, 0])
    # top_k >= vocab filters nothing.
    for k in (4, 5, 2000):
        assert close(freqs(LOGITS, n=5000, top_k=k), PROBS.tolist())


def test_top_k_with_top_p_and_min_p(top_k_path: str) -> None:
    # probs [0.4, 0.25, 0.2, 0.1, 0.05]; top_k=4 -> [0.421, 0.263, 0.211, 0.105];
    # top_p=0.8 keeps the first 3 (before the 4th: 0.895); min_p=0.55 drops 0.211 (< 0.232).
    probs = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05])
    got = freqs(probs.log(), top_k=4, top_p=0.8)
    assert got[3] == got[4] == 0.0 and close(got, [0.4 / 0.85, 0.25 / 0.85, 0.2 / 0.85, 0, 0])
    got = freqs(probs.log(), top_k=4, top_p=0.8, min_p=0.55)
    assert got[2] == got[3] == got[4] == 0.0 and close(got, [0.4 / 0.65, 0.25 / 0.65, 0, 0, 0])
    # Rows without top_p or min_p keep their whole top-k list, tail included.
    got = freqs(probs.log(), top_k=4, temperature=3.0)
    want = torch.softmax(probs[:4].log() / 3.0, -1).tolist() + [0.0]
    assert got[4] == 0.0 and close(got, want)


def test_top_p_is_nucleus_of_top_k_distribution(top_k_path: str) -> None:
    # probs [0.4, 0.3, 0.2, 0.1]; top_k=2 renormalizes to [4/7, 3/7]; top_p=0.5 on that keeps
    # only token 0 (before token 1: 4/7 >= 0.5). On the raw distribution it would keep {0, 1}.
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    assert freqs(logits, n=2000, top_k=2, top_p=0.5) == [1.0, 0.0, 0.0, 0.0]


def test_top_p() -> None:
    # Mass before token 2 is 0.8 >= 0.7: keep {0, 1}.
    got = freqs(LOGITS, top_p=0.7)
    assert got[2] == got[3] == 0.0 and close(got, [0.625, 0.375, 0, 0])
    # 0.8 < 0.85: token 2 survives, token 3 (0.95 before it) does not.
    got = freqs(LOGITS, top_p=0.85)
    assert got[3] == 0.0 and close(got, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0])


def test_top_p_tiny_is_argmax() -> None:
    torch.manual_seed(0)
    logits = torch.randn(64, 500)
    s = Sampler(500)
    out = s.sample(logits, [row(top_p=1e-6, seed=i if i % 2 else None) for i in range(64)])
    assert out.next_token_ids == logits.argmax(-1).tolist()
    assert s.stats.top_p_rows == 64


def test_min_p() -> None:
    # Threshold 0.35 * 0.5 = 0.175: keeps 0.5 and 0.3 only.
    got = freqs(LOGITS, min_p=0.35)
    assert got[2] == got[3] == 0.0 and close(got, [0.625, 0.375, 0, 0])
    # min_p = 0.25 (threshold 0.125) keeps 0.15 too.
    got = freqs(LOGITS, min_p=0.25)
    assert got[3] == 0.0 and close(got, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0])


def test_filters_combine_after_temperature() -> None:
    # T=0.5 gives probs ~ [0.676, 0.243, 0.061, 0.007]; top_p=0.9 keeps {0, 1}.
    p = torch.softmax(LOGITS / 0.5, -1)
    got = freqs(LOGITS, temperature=0.5, top_p=0.9)
    keep = p[:2] / p[:2].sum()
    assert got[2] == got[3] == 0.0 and close(got, keep.tolist() + [0, 0])


def test_filters_skipped_when_not_needed() -> None:
    s = Sampler(4)
    freqs(LOGITS, n=10, sampler=s)
    assert (s.stats.top_k_rows, s.stats.top_p_rows, s.stats.min_p_rows) == (0, 0, 0)
    freqs(LOGITS, n=10, sampler=s, top_k=-1, top_p=1.0, min_p=0.0)
    assert (s.stats.top_k_rows, s.stats.top_p_rows, s.stats.min_p_rows) == (0, 0, 0)
    freqs(LOGITS, n=10, sampler=s, top_k=3)
    assert (s.stats.top_k_rows, s.stats.top_p_rows) == (10, 0)


def test_seeded_rows_follow_the_distribution() -> None:
    # One row per seed: checks the per-(seed, index) noise is proper Exp(1) noise.
    n = 4000
    s = Sampler(4)
    ids = s.sample(LOGITS.expand(n, 4).clone(), [row(seed=i) for i in range(n)]).next_token_ids
    c = Counter(ids)
    assert all(abs(c[t] / n - PROBS[t].item()) < 0.035 for t in range(4))
    assert s.stats.seeded_rows == n


def test_unseeded_rows_follow_sampler_seed() -> None:
    torch.manual_seed(4)
    logits = torch.randn(8, 50)
    rows = [row() for _ in range(8)]
    a = Sampler(50, seed=7)
    b = Sampler(50, seed=7)
    seq_a = [a.sample(logits, rows).next_token_ids for _ in range(3)]
    seq_b = [b.sample(logits, rows).next_token_ids for _ in range(3)]
    assert seq_a == seq_b
    assert seq_a[0] != seq_a[1]  # the generator advances between calls
    assert Sampler(50, seed=8).sample(logits, rows).next_token_ids != seq_a[0]


def test_seeded_token_depends_on_output_index() -> None:
    torch.manual_seed(5)
    logits = torch.randn(1, 1000)
    s = Sampler(1000)
    toks = [s.sample(logits, [row([3] * k, seed=11)]).next_token_ids[0] for k in range(20)]
    assert len(set(toks)) > 5
    # Retraction: recomputing the same output index gives the same token.
    assert toks == [s.sample(logits, [row([9] * k, seed=11)]).next_token_ids[0] for k in range(20)]
    assert mix_seed(11, 0) != mix_seed(11, 1) != mix_seed(12, 0)


VOCAB = 300
TARGET = torch.randn(VOCAB, generator=torch.Generator().manual_seed(99)) * 2
other_params = st.fixed_dictionaries({
    "temperature": st.sampled_from([0.0, 0.7, 1.0, 1.5]),
    "top_k": st.sampled_from([-1, 1, 5, 50]),
    "top_p": st.sampled_from([1.0, 0.9, 0.5]),
    "min_p": st.sampled_from([0.0, 0.1]),
    "repetition_penalty": st.sampled_from([1.0, 1.3]),
    "presence_penalty": st.sampled_from([0.0, 0.5]),
    "seed": st.one_of(st.none(), st.integers(0, 2**40)),
})
target_params = st.fixed_dictionaries({
    "temperature": st.sampled_from([0.6, 1.0, 1.4]),
    "top_k": st.sampled_from([-1, 20]),
    "top_p": st.sampled_from([1.0, 0.8]),
    "min_p": st.sampled_from([0.0, 0.05]),
    "seed": st.integers(-2**40, 2**62),
})


@settings(max_examples=40, deadline=None)
@given(target=target_params, k=st.integers(0, 50), others=st.lists(other_params, max_size=6),
       pos=st.integers(0, 6), sampler_seed=st.integers(0, 1000))
def test_seeded_sampling_independent_of_batch(target: dict, k: int, others: list[dict], pos: int,
                                              sampler_seed: int) -> None:
    out_ids = [(7 * i) % VOCAB for i in range(k)]
    alone = Sampler(VOCAB).sample(TARGET[None].clone(), [row(out_ids, **target)]).next_token_ids[0]

    pos = min(pos, len(others))
    gen = torch.Generator().manual_seed(sampler_seed)
    rows = [row([1, 2, 3], **o) for o in others]
    logits = [torch.randn(VOCAB, generator=gen) for _ in others]
    rows.insert(pos, row(out_ids, **target))
    logits.insert(pos, TARGET)
    s = Sampler(VOCAB, seed=sampler_seed)
    s.sample(torch.stack(logits), rows)  # advance the sampler's own generator first
    got = s.sample(torch.stack(logits), rows).next_token_ids[pos]
    assert got == alone


@pytest.mark.parametrize("block", [256, 3, 1])
def test_two_level_cdf_across_blocks(block: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Heavy tokens spread over several CDF blocks, vocab not a multiple of the block."""
    monkeypatch.setattr(sampler_mod, "_CDF_BLOCK", block)
    v = 601
    want = torch.full((v,), 1e-9)
    for tok, p in ((0, 0.2), (255, 0.1), (256, 0.3), (599, 0.15), (600, 0.25)):
        want[tok] = p
    got = freqs(want.log(), sampler=Sampler(v, seed=5))
    assert close(got, want.tolist())
    assert sum(got[t] for t in (0, 255, 256, 599, 600)) > 0.999


def test_caller_logits_untouched() -> None:
    torch.manual_seed(6)
    logits = torch.randn(4, 64)
    before = logits.clone()
    rows = [row([1, 2], temperature=0.7, top_k=5, top_p=0.8, min_p=0.1, repetition_penalty=1.5,
                logit_bias={3: 2.0}),
            row(temperature=1.0), row(temperature=0.0, presence_penalty=1.0), row(temperature=2.0)]
    Sampler(64).sample(logits, rows)
    assert torch.equal(logits, before)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu_for_greedy_and_seeded() -> None:
    torch.manual_seed(7)
    logits = torch.randn(6, 1000) * 3
    rows = [row([1, 2, 3], temperature=0.0, repetition_penalty=1.3),
            row([4], temperature=0.8, top_p=0.9, seed=3),
            row([], temperature=1.0, top_k=20, seed=4),
            row([5, 5], temperature=0.6, min_p=0.05, frequency_penalty=0.5, seed=5),
            row([], temperature=1.0),
            row([], temperature=0.0, logit_bias={7: 100.0})]
    cpu = Sampler(1000).sample(logits, rows).next_token_ids
    gpu = Sampler(1000, device="cuda").sample(logits.cuda(), rows).next_token_ids
    for i in (0, 1, 2, 3, 5):
        assert cpu[i] == gpu[i], i
    assert cpu[5] == 7
