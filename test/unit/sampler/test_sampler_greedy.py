"""Greedy decoding: argmax, the fast path, dtype and vocab padding handling."""
from __future__ import annotations

import torch

from radixlm.sampling_params import SamplingParams
from radixlm.srt.model_runner.sampler import Sampler, SamplingRow


def row(output_ids: list[int] | None = None, prompt_ids: list[int] | None = None,
        stop_ids: frozenset[int] = frozenset(), **kw) -> SamplingRow:
    lp = {k: kw.pop(k) for k in ("return_logprob", "top_logprobs_num") if k in kw}
    return SamplingRow(SamplingParams.from_dict(kw), prompt_ids or [1, 2], output_ids or [],
                       stop_ids, **lp)


def test_greedy_is_argmax_and_takes_fast_path() -> None:
    torch.manual_seed(0)
    logits = torch.randn(7, 100)
    s = Sampler(100)
    out = s.sample(logits, [row(temperature=0.0) for _ in range(7)])
    assert out.next_token_ids == logits.argmax(-1).tolist()
    assert s.stats.fast_path_calls == 1 and s.stats.calls == 1
    assert out.logprobs == [None] * 7 and out.top_logprobs == [None] * 7


def test_top_k_one_is_greedy() -> None:
    torch.manual_seed(1)
    logits = torch.randn(5, 64)
    s = Sampler(64)
    out = s.sample(logits, [row(temperature=1.3, top_k=1, seed=i) for i in range(5)])
    assert out.next_token_ids == logits.argmax(-1).tolist()
    assert s.stats.fast_path_calls == 1


def test_logprobs_do_not_leave_fast_path() -> None:
    logits = torch.randn(3, 32)
    s = Sampler(32)
    out = s.sample(logits, [row(temperature=0.0, return_logprob=True) for _ in range(3)])
    assert s.stats.fast_path_calls == 1
    assert all(lp is not None for lp in out.logprobs)


def test_fast_path_not_taken_with_penalty_bias_min_new_or_random() -> None:
    logits = torch.randn(2, 32)
    cases = [
        dict(temperature=0.0, repetition_penalty=1.2),
        dict(temperature=0.0, frequency_penalty=0.5),
        dict(temperature=0.0, presence_penalty=0.5),
        dict(temperature=0.0, logit_bias={3: 1.0}),
        dict(temperature=1.0),
    ]
    for kw in cases:
        s = Sampler(32)
        s.sample(logits, [row(temperature=0.0), row(**kw)])
        assert s.stats.fast_path_calls == 0, kw
    # min_new_tokens only matters while it is not reached and there are stop ids.
    s = Sampler(32)
    s.sample(logits[:1], [row(temperature=0.0, max_new_tokens=8, min_new_tokens=2,
                          stop_ids=frozenset({1}))])
    assert s.stats.fast_path_calls == 0
    s.sample(logits[:1], [row([5, 6], temperature=0.0, max_new_tokens=8, min_new_tokens=2,
                          stop_ids=frozenset({1}))])
    assert s.stats.fast_path_calls == 1


def test_bf16_logits_and_padded_vocab() -> None:
    torch.manual_seed(2)
    logits = torch.randn(4, 40)
    logits[:, 32:] = 100.0  # padded lm_head columns beyond the real vocab: never sampled
    s = Sampler(32)
    want = logits[:, :32].argmax(-1).tolist()
    assert s.sample(logits.to(torch.bfloat16), [row(temperature=0.0) for _ in range(4)]).next_token_ids == \
        logits[:, :32].to(torch.bfloat16).argmax(-1).tolist()
    assert s.sample(logits, [row(temperature=0.0, presence_penalty=0.1) for _ in range(4)]).next_token_ids == want
    out = s.sample(logits, [row(temperature=1.0) for _ in range(4)])
    assert all(t < 32 for t in out.next_token_ids)


def test_mixed_batch_greedy_rows_still_argmax() -> None:
    torch.manual_seed(3)
    logits = torch.randn(6, 50)
    rows = [row(temperature=0.0) if i % 2 == 0 else row(temperature=1.0) for i in range(6)]
    out = Sampler(50).sample(logits, rows)
    want = logits.argmax(-1).tolist()
    assert [out.next_token_ids[i] for i in (0, 2, 4)] == [want[i] for i in (0, 2, 4)]


def test_empty_batch() -> None:
    out = Sampler(8).sample(torch.empty(0, 8), [])
    assert out.next_token_ids == [] and out.logprobs == [] and out.top_logprobs == []
