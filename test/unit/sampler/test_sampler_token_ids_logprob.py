"""token_ids_logprob: a row's top list is its top_logprobs_num best entries, then the asked ids'
raw logprobs in the order asked (sampled tokens and prompt positions alike)."""
from __future__ import annotations

import pytest
import torch

from radixlm.sampling_params import SamplingParams
from radixlm.srt.model_runner.sampler import Sampler, SamplingRow


def row(top: int, asked: tuple[int, ...], return_logprob: bool = True, **kw) -> SamplingRow:
    return SamplingRow(SamplingParams.from_dict(kw), [0, 1], [2], frozenset(), return_logprob, top, asked)


def test_asked_ids_follow_the_top_entries():
    torch.manual_seed(1)
    logits = torch.randn(4, 50) * 2
    rows = [row(0, (3, 49, 3)), row(2, (0,), temperature=0.8, seed=4), row(3, ()), row(0, (5,), False)]
    out = Sampler(50).sample(logits, rows)
    ref = torch.log_softmax(logits, -1)
    assert [t for _, t in out.top_logprobs[0]] == [3, 49, 3]
    assert [lp for lp, _ in out.top_logprobs[0]] == pytest.approx(ref[0, [3, 49, 3]].tolist(), abs=1e-6)
    top2 = ref[1].topk(2)
    assert [t for _, t in out.top_logprobs[1]] == top2.indices.tolist() + [0]
    assert [lp for lp, _ in out.top_logprobs[1]] == pytest.approx(top2.values.tolist() + [ref[1, 0].item()],
                                                                  abs=1e-6)
    assert len(out.top_logprobs[2]) == 3
    assert out.top_logprobs[3] is None  # asked without return_logprob: nothing computed


def test_prompt_positions_report_the_asked_ids():
    torch.manual_seed(2)
    logits = torch.randn(5, 30)
    targets = [1, 2, 3, 4, 5]
    lps, tops = Sampler(30).logprobs_of(logits, targets, 1, (7, 0))
    ref = torch.log_softmax(logits, -1)
    for i in range(5):
        assert [t for _, t in tops[i]] == [int(ref[i].argmax()), 7, 0]
        assert [lp for lp, _ in tops[i][1:]] == pytest.approx(ref[i, [7, 0]].tolist(), abs=1e-6)
    _, none = Sampler(30).logprobs_of(logits, targets, 0, (9,))
    assert [[t for _, t in x] for x in none] == [[9]] * 5
