"""Prompt (input) logprobs from `logprob_start_len` survive every prefix-cache state.

Position p's hidden state gives the logprob of token p + 1, so input logprobs from token s
need positions s - 1 onwards computed: the cached prefix may cover at most s - 1 tokens.
Each case checks the exact tokens reported, in order, against the prompt."""
from __future__ import annotations

import pytest

from radixlm.messages import TokenizedGenerateReq
from radixlm.sampling_params import SamplingParams

from test.support.scheduler_harness import make_harness

PROMPT = [11, 12, 13, 14, 15, 16, 17]


def submit_lp(h, prompt, start, rid, top=0, **sp):
    sp.setdefault("max_new_tokens", 2)
    h.scheduler.add_request(TokenizedGenerateReq(rid=rid, input_ids=list(prompt),
                                                 sampling_params=SamplingParams.from_dict(sp),
                                                 return_logprob=True, top_logprobs_num=top,
                                                 logprob_start_len=start))
    return rid


def input_lps(h, rid):
    got = [o.input_token_logprobs for o in h.outputs[rid] if o.input_token_logprobs is not None]
    assert len(got) == 1, f"input logprobs sent {len(got)} times"
    return got[0]


def expected(prompt, start):
    """(logprob is None, token) per prompt position from `start` (token 0 has no logprob)."""
    return [(i == 0, prompt[i]) for i in range(start, len(prompt))]


def shape(lps):
    return [(lp is None, tok) for lp, tok in lps]


@pytest.mark.parametrize("cached", [1, 2, 4, 6])
@pytest.mark.parametrize("start", [0, 1, 2, 3, 6, 7])
def test_input_logprobs_complete_whatever_is_cached(cached, start):
    h = make_harness()
    h.submit(PROMPT[:cached] + [90 + cached], max_new_tokens=1)  # leaves PROMPT[:cached] in the tree
    h.run()
    rid = submit_lp(h, PROMPT, start, "lp")
    h.run()
    assert shape(input_lps(h, rid)) == expected(PROMPT, start)
    # what could be reused was: the cache covers at most start - 1 positions
    assert h.final(rid).cached_tokens == min(cached, max(start - 1, 0), len(PROMPT) - 1)
    h.assert_idle_and_conserved()


def test_issue_case_seven_tokens_start_one_one_cached():
    h = make_harness()
    h.submit(PROMPT[:1] + [99], max_new_tokens=1)
    h.run()
    rid = submit_lp(h, PROMPT, 1, "lp", top=2)
    h.run()
    lps = input_lps(h, rid)
    assert [tok for _, tok in lps] == PROMPT[1:]
    assert all(lp is not None for lp, _ in lps)
    tops = [o.input_top_logprobs for o in h.outputs[rid] if o.input_top_logprobs is not None][0]
    assert len(tops) == len(lps)


@pytest.mark.parametrize("start", [0, 1, 5])
def test_input_logprobs_complete_across_chunks(start):
    h = make_harness(chunk=3)
    h.submit(PROMPT[:4] + [98], max_new_tokens=1)
    h.run()
    rid = submit_lp(h, PROMPT + [18, 19, 20], start, "lp")
    h.run()
    assert shape(input_lps(h, rid)) == expected(PROMPT + [18, 19, 20], start)
    h.assert_idle_and_conserved()


def test_pause_retract_during_chunked_prefill_does_not_duplicate_input_logprobs():
    h = make_harness(chunk=3)
    prompt = list(range(20, 32))
    rid = submit_lp(h, prompt, 2, "lp")
    h.scheduler.step()  # first chunk computed (and its logprobs recorded)
    h.scheduler.pause("retract")
    h.scheduler.resume()
    h.run()
    assert shape(input_lps(h, rid)) == expected(prompt, 2)
    h.assert_idle_and_conserved()


def test_one_token_prompt_from_zero_reports_its_none_entry():
    """The first prompt token has no logprob but is listed (echo=True with logprobs needs it)."""
    h = make_harness()
    rid = submit_lp(h, [42], 0, "lp", top=1)
    h.run()
    assert shape(input_lps(h, rid)) == [(True, 42)]
