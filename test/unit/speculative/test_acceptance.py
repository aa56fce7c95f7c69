"""Draft verification: greedy = argmax chain, sampled rows keep the target distribution, and
everything the sampler applies per output index (penalties, min_new_tokens, seeds) sees the
drafts as if they had been decoded one by one."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from radixlm.sampling_params import SamplingParams
from radixlm.speculative.acceptance import Verified, verify_drafts
from radixlm.srt.model_runner.sampler import Sampler, SamplingRow

V = 6
N = 20000
# Total-variation bound for N draws over V tokens: the expected TV of an exact sampler is about
# 0.5 * sum_i sqrt(2 p_i / (pi N)) < 0.01 here; the wrong implementations below are >= 0.2 off.
TV_BOUND = 0.025


def row(output_ids: list[int] | None = None, stop_ids: frozenset[int] = frozenset(), **kw) -> SamplingRow:
    params = SamplingParams.from_dict(kw)
    params.normalize()
    return SamplingRow(params, [1, 2], list(output_ids or []), stop_ids)


def lp_row(**kw) -> SamplingRow:
    r = row(**kw)
    r.return_logprob, r.top_logprobs_num = True, 2
    return r


def tv(samples: list[int], probs: torch.Tensor) -> float:
    c = Counter(samples)
    n = len(samples)
    return 0.5 * sum(abs(c[t] / n - float(probs[t])) for t in range(probs.numel()))


def target_top_k(logits: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    """The target distribution written out independently of the sampler."""
    p = torch.softmax(logits / temperature, -1)
    keep = torch.zeros_like(p, dtype=torch.bool)
    keep[p.topk(top_k).indices] = True
    p = torch.where(keep, p, torch.zeros_like(p))
    return p / p.sum()


def test_greedy_accepts_the_longest_prefix_of_the_argmax_chain():
    g = torch.Generator().manual_seed(0)
    drafts = [[], [9, 9], [0, 0, 0], [0, 0, 0]]
    logits = torch.randn(sum(len(d) + 1 for d in drafts), 16, generator=g)
    chain = logits.argmax(-1).tolist()
    # Row 1 is wrong at its first draft; row 2 right on two then wrong; row 3 right on all.
    drafts[1] = [(chain[1] + 1) % 16, chain[2]]
    drafts[2] = [chain[4], chain[5], (chain[6] + 3) % 16]
    drafts[3] = chain[8:11]
    out = verify_drafts(Sampler(16), logits, [row(temperature=0)] * 4, drafts)
    assert [v.tokens for v in out] == [[chain[0]], [chain[1]], chain[4:7], chain[8:12]]
    assert [v.num_accepted for v in out] == [0, 0, 2, 3]
    assert [v.kv_keep for v in out] == [1, 1, 3, 4]
    assert [v.num_drafted for v in out] == [0, 2, 3, 3]


def test_penalties_see_the_drafts_before_each_position():
    # The same logits at both positions; the frequency penalty on token 0 after draft 0
    # turns position 1's argmax into token 1. Positions scored without the draft in the
    # output ids would emit 0 again.
    logits = torch.tensor([[2.0, 1.9, 0, 0, 0, 0]] * 3)
    r = row(temperature=0, frequency_penalty=0.5)
    (v,) = verify_drafts(Sampler(V), logits, [r], [[0, 1]])
    assert v.tokens == [0, 1, 0] and v.num_accepted == 2  # position 2: 0 has 1.5, 1 has 1.4
    s = Sampler(V)
    seq = []
    for j in range(3):
        seq += s.sample(logits[j:j + 1], [row(seq, temperature=0, frequency_penalty=0.5)]).next_token_ids
    assert seq == v.tokens


def test_min_new_tokens_mask_moves_with_the_drafts():
    logits = torch.tensor([[5.0, 4.0, 3.0, 0, 0, 0]] * 3)
    r = row(stop_ids=frozenset({0}), temperature=0, min_new_tokens=2)
    (v,) = verify_drafts(Sampler(V), logits, [r], [[1, 1]])
    assert v.tokens == [1, 1, 0]  # the stop token becomes possible at output index 2 only


def test_seeded_rows_emit_what_non_speculative_sampling_emits():
    g = torch.Generator().manual_seed(1)
    k = 3
    logits = torch.randn(k + 1, V, generator=g) * 2.5
    kinds = [{"temperature": 1.0}, {"temperature": 0.7, "top_p": 0.8}, {"temperature": 1.3, "top_k": 3},
             {"temperature": 1.0, "min_p": 0.1, "presence_penalty": 0.7}]
    accepted = 0
    for seed in range(60):
        for kw in kinds:
            # Draft the most likely tokens so that runs get accepted often enough to matter.
            draft = logits[:k].argmax(-1).tolist()
            (v,) = verify_drafts(Sampler(V), logits, [row([3], seed=seed, **kw)], [draft])
            s = Sampler(V, seed=999)  # a seeded row must not depend on the sampler's own seed
            seq: list[int] = []
            for j in range(len(v.tokens)):
                seq += s.sample(logits[j:j + 1], [row([3] + seq, seed=seed, **kw)]).next_token_ids
            assert seq == v.tokens, (seed, kw)
            accepted += v.num_accepted
    assert accepted > 60  # the comparison covered accepted runs, not only first tokens


def _first_and_second(out: list[Verified]) -> tuple[list[int], list[int]]:
    first = [v.tokens[0] for v in out]
    second = [v.tokens[1] for v in out if len(v.tokens) > 1]
    return first, second


def test_sampled_rows_keep_the_target_distribution():
    logits = torch.tensor([[1.2, 0.9, 0.3, -0.5, 0.0, -2.0],
                           [0.1, 1.5, -0.3, 0.8, 0.2, 0.0]])
    t, top_k, d = 0.9, 4, 1
    p0 = target_top_k(logits[0], t, top_k)
    p1 = target_top_k(logits[1], t, top_k)
    assert 0.15 < float(p0[d]) < 0.5  # the draft is accepted sometimes, rejected often
    out = verify_drafts(Sampler(V, seed=5), logits.repeat(N, 1), [row(temperature=t, top_k=top_k)] * N,
                        [[d]] * N)
    first, second = _first_and_second(out)
    assert tv(first, p0) < TV_BOUND
    # Given that the draft was accepted, the bonus token follows the next position's target.
    assert len(second) == first.count(d)
    assert tv(second, p1) < 2 * TV_BOUND
    # The check above is strong enough to catch the classic mistakes:
    g = torch.Generator().manual_seed(5)
    always_accept = [d] * N
    u = torch.rand(N, generator=g)
    # Accept with p(d), but on rejection resample from p without removing d.
    no_removal = [d if float(u[i]) < float(p0[d]) else int(torch.multinomial(p0, 1, generator=g))
                  for i in range(N)]
    assert tv(always_accept, p0) > 4 * TV_BOUND
    assert tv(no_removal, p0) > 4 * TV_BOUND


def test_a_draft_outside_top_k_is_never_accepted():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.4, -1.0, -3.0]] * 2)
    out = verify_drafts(Sampler(V, seed=2), logits.repeat(N // 4, 1), [row(temperature=1.0, top_k=2)] * (N // 4),
                        [[5]] * (N // 4))
    assert all(v.num_accepted == 0 and len(v.tokens) == 1 for v in out)
    assert tv([v.tokens[0] for v in out], target_top_k(logits[0], 1.0, 2)) < 2 * TV_BOUND


def test_logprobs_are_the_raw_model_logprobs_per_position():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, V, generator=g)
    chain = logits.argmax(-1).tolist()
    (v,) = verify_drafts(Sampler(V), logits, [lp_row(temperature=0)], [chain[:2]])
    lsm = torch.log_softmax(logits, -1)
    assert v.tokens == chain
    assert v.logprobs == pytest.approx([float(lsm[j, chain[j]]) for j in range(3)])
    assert [top[0][1] for top in v.top_logprobs] == chain and all(len(t) == 2 for t in v.top_logprobs)
    cut = v.truncated(2)
    assert cut.tokens == chain[:2] and cut.logprobs == v.logprobs[:2] and cut.kv_keep == 2
    with pytest.raises(ValueError):
        v.truncated(0)
    with pytest.raises(ValueError):
        v.truncated(4)


def test_shape_errors_and_empty_batch():
    s = Sampler(V)
    with pytest.raises(ValueError):
        verify_drafts(s, torch.zeros(2, V), [row(temperature=0)], [[1, 2]])
    with pytest.raises(ValueError):
        verify_drafts(s, torch.zeros(1, V), [row(temperature=0)], [[], []])
    assert verify_drafts(s, torch.zeros(0, V), [], []) == []
