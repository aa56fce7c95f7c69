"""Logprobs are the raw model's: log_softmax of unprocessed logits."""
from __future__ import annotations

import pytest
import torch

import radixlm.srt.model_runner.sampler as sampler_mod
from radixlm.sampling_params import SamplingParams
from radixlm.srt.model_runner.sampler import Sampler, SamplingRow


def row(return_logprob: bool = False, top: int = 0, **kw) -> SamplingRow:
    return SamplingRow(SamplingParams.from_dict(kw), [0, 1, 2], [3, 3], frozenset(),
                       return_logprob, top)


def test_chosen_logprob_is_raw_log_softmax() -> None:
    torch.manual_seed(0)
    logits = torch.randn(5, 80) * 3
    rows = [
        row(True, temperature=0.0),
        row(False, temperature=0.7),
        row(True, 4, temperature=0.5, top_p=0.8, repetition_penalty=1.5, seed=1),
        row(True, 2, temperature=1.0, logit_bias={7: 5.0}, frequency_penalty=1.0),
        row(False, 3, temperature=0.0),  # top_logprobs_num without return_logprob: ignored
    ]
    out = Sampler(80).sample(logits, rows)
    ref = torch.log_softmax(logits, -1)
    for i in (0, 2, 3):
        assert out.logprobs[i] == pytest.approx(ref[i, out.next_token_ids[i]].item(), abs=1e-6)
    assert out.logprobs[1] is None and out.logprobs[4] is None
    assert out.top_logprobs[0] is None and out.top_logprobs[1] is None and out.top_logprobs[4] is None
    for i, k in ((2, 4), (3, 2)):
        tops = out.top_logprobs[i]
        assert tops is not None and len(tops) == k
        assert [lp for lp, _ in tops] == sorted((lp for lp, _ in tops), reverse=True)
        vals, inds = ref[i].topk(k)
        assert [t for _, t in tops] == inds.tolist()
        assert [lp for lp, _ in tops] == pytest.approx(vals.tolist(), abs=1e-6)


def test_fast_path_logprobs_and_bf16() -> None:
    torch.manual_seed(1)
    logits = torch.randn(3, 40).to(torch.bfloat16)
    out = Sampler(40).sample(logits, [row(True, 40, temperature=0.0) for _ in range(3)])
    ref = torch.log_softmax(logits.float(), -1)
    for i in range(3):
        assert out.logprobs[i] == pytest.approx(ref[i].max().item(), abs=1e-6)
        assert out.top_logprobs[i][0] == (out.logprobs[i], out.next_token_ids[i])
        assert len(out.top_logprobs[i]) == 40


def test_logprobs_of_prompt(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sampler_mod, "_LOGPROB_CHUNK", 3)  # exercise chunking
    torch.manual_seed(2)
    logits = torch.randn(10, 30)
    toks = torch.randint(0, 30, (10,))
    s = Sampler(30)
    lps, tops = s.logprobs_of(logits, toks, 3)
    ref = torch.log_softmax(logits, -1)
    assert lps == pytest.approx(ref.gather(1, toks[:, None]).squeeze(1).tolist(), abs=1e-6)
    assert len(tops) == 10
    for i, t in enumerate(tops):
        vals, inds = ref[i].topk(3)
        assert [x for _, x in t] == inds.tolist()
        assert [v for v, _ in t] == pytest.approx(vals.tolist(), abs=1e-6)
    lps2, tops2 = s.logprobs_of(logits, toks.tolist(), 0)
    assert lps2 == lps and tops2 == [[] for _ in range(10)]
    with pytest.raises(ValueError):
        s.logprobs_of(logits, toks[:5], 0)
