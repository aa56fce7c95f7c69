"""The error boundary on the real model runner, in process: the sampler raises for one row
of a batch (a request with seed 666); the co-batched requests get the tokens they get when
run alone, the bad one a 500 abort, and every pool invariant holds after every step."""
from __future__ import annotations

import pytest

from radixlm.config import ServerArgs
from radixlm.messages import TokenizedGenerateReq
from radixlm.sampling_params import SamplingParams
from radixlm.srt.scheduler_process import build_scheduler

PROMPTS = [[1, 5, 9, 200], [7, 8, 9, 10, 11, 12], [300, 301], [42] * 9]


def _run(sched, reqs) -> dict:
    outs: dict = {}
    sched.send_output = lambda batch: [outs.setdefault(o.rid, []).append(o) for o in batch.outputs]
    for r in reqs:
        sched.handle(r)
    for _ in range(500):
        if not sched.step():
            break
        sched.check_integrity()
    assert sched.is_idle()
    return outs


def _req(rid: str, prompt: list[int], **sp) -> TokenizedGenerateReq:
    return TokenizedGenerateReq(rid=rid, input_ids=prompt, sampling_params=SamplingParams(
        max_new_tokens=6, ignore_eos=True, **sp), return_logprob=True)


@pytest.mark.parametrize("overlap", [False, True])
def test_sampler_failure_in_one_row(tiny_llama_dir, overlap):
    args = ServerArgs(model_path=tiny_llama_dir, dtype="float32", device="cpu", max_total_tokens=4096,
                      debug_check_integrity=True, enable_overlap_schedule=overlap,
                      disable_overlap_schedule=not overlap)
    sched, runner = build_scheduler(args, lambda batch: None)
    alone = {}
    for i, p in enumerate(PROMPTS):
        alone[i] = [t for o in _run(sched, [_req(f"solo{i}", p, temperature=0.0)])[f"solo{i}"]
                    for t in o.new_token_ids]
    real = runner.sampler.sample_tensors

    def sample(logits, rows, vocab_mask=None):
        if any(r.params.seed == 666 for r in rows) and len(rows) > 0:
            # fail only once the bad request has a token, so decode batches are hit too
            if any(r.params.seed == 666 and len(r.output_ids) >= 2 for r in rows):
                raise RuntimeError("injected sampler failure")
        return real(logits, rows, vocab_mask)
    runner.sampler.sample_tensors = sample
    reqs = [_req(f"ok{i}", p, temperature=0.0) for i, p in enumerate(PROMPTS)]
    reqs.insert(2, _req("bad", [3, 4, 5], temperature=0.7, seed=666))
    outs = _run(sched, reqs)
    for i in range(len(PROMPTS)):
        got = outs[f"ok{i}"]
        assert [t for o in got for t in o.new_token_ids] == alone[i]
        # every request's tokens come in stream_interval deltas (non-streamed too), each with its logprobs
        assert got[-1].finish_reason["type"] == "length" and sum(len(o.output_token_logprobs) for o in got) == 6
    fr = outs["bad"][-1].finish_reason
    assert fr["type"] == "abort" and fr["status_code"] == 500 and "injected sampler failure" in fr["message"]
    assert sched.stats.num_batch_replays >= 1
    mem = sched.cache.memory_stats()
    assert mem["protected"] == 0 and mem["free"] + mem["evictable"] == mem["capacity"]
