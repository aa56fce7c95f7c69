"""Overlap's device-side futures on the real runner (tiny model), with the CUDA stream's
asynchronous host copies simulated on the CPU (test/support/overlap_batches.DeferredCopyStream):

- a decode batch whose inputs name the previous batch's rows is launched without the host
  reading that batch's tokens (its copy-done event is not waited), unless a row has
  penalties, which read the values;
- nothing reads a host copy before its event: the copies hold poison until then;
- the whole scheduler with overlap on and this stream gives the outputs of overlap off.
"""
from __future__ import annotations

import pytest
import torch

from radixlm.config import ServerArgs
from radixlm.messages import TokenizedGenerateReq
from radixlm.sampling_params import SamplingParams
from radixlm.srt.model_runner.launched import LaunchedBatch
from test.support.engine_checks import random_prompt
from test.support.overlap_batches import DeferredCopyStream, decode_batch, free_reqs, make_req, prefill_batch


@pytest.fixture(scope="module")
def runner(tiny_llama_dir):
    from radixlm.srt.model_runner.runner import ModelRunner
    return ModelRunner(ServerArgs.from_kwargs(model_path=tiny_llama_dir, dtype="float32", max_total_tokens=1024,
                                              max_running_requests=8).runner_config())


def _two_steps(runner, params: list[dict], overlap: bool):
    """Prefill + one decode of len(params) requests; returns (prefill, decode) launches."""
    reqs = [make_req(f"r{i}", random_prompt(40 + i, 9 + 3 * i), runner, **p) for i, p in enumerate(params)]
    try:
        first = prefill_batch(runner, reqs)
        l1 = runner.launch(first)
        if overlap:
            l2 = runner.launch(decode_batch(runner, reqs, source=first), l1)
        else:
            toks = l1.result().next_token_ids
            l2 = runner.launch(decode_batch(runner, reqs, tokens=toks))
        return l1, l2
    finally:
        free_reqs(runner, reqs, 1)


PARAMS = [{}, {"return_logprob": True, "top_logprobs_num": 3}, {"temperature": 0.9, "seed": 11}]


def _results(l1, l2):
    a, b = l1.result(), l2.result()
    return (a.next_token_ids, b.next_token_ids, b.logprobs, b.top_logprobs)


def _two_steps_deferred(runner, params: list[dict]):
    """_two_steps with overlap, on a DeferredCopyStream; returns (prefill, decode, stream)."""
    stream = DeferredCopyStream()
    old, runner.stream = runner.stream, stream
    try:
        l1, l2 = _two_steps(runner, params, overlap=True)
    finally:
        runner.stream = old
    return l1, l2, stream


def test_next_batch_launches_without_reading_the_previous_tokens(runner):
    want = _results(*_two_steps(runner, PARAMS, overlap=False))
    l1, l2, stream = _two_steps_deferred(runner, PARAMS)
    assert isinstance(l1, LaunchedBatch)
    assert [e.syncs for e in stream.events] == [0, 0]  # both launched, nothing waited yet
    # before its event, the host copy is poison: a premature read would return garbage
    assert l2.sampled.ids.tolist() == [-7777] * len(PARAMS)
    got = _results(l1, l2)
    assert [e.syncs for e in stream.events] == [1, 1]
    assert got == want
    assert l2.result() is l2.result() and stream.events[1].syncs == 1  # built once
    assert torch.equal(l1.tokens, torch.tensor(want[0]))  # the device-side tokens placeholders read


def test_penalty_rows_wait_for_the_previous_tokens(runner):
    params = [{}, {"repetition_penalty": 1.7, "frequency_penalty": 0.4}]
    want = _results(*_two_steps(runner, params, overlap=False))
    l1, l2, stream = _two_steps_deferred(runner, params)
    assert [e.syncs for e in stream.events] == [1, 0]  # the launch of the decode waited for the prefill
    assert l2.batch.output_snapshots == [[t] for t in want[0]]  # placeholders filled with the values
    assert _results(l1, l2) == want


def test_unsampled_rows_are_minus_one_on_the_device(runner):
    reqs = [make_req("a", random_prompt(1, 7), runner), make_req("b", random_prompt(2, 5), runner)]
    batch = prefill_batch(runner, reqs)
    batch.sample = [False, True]  # a's chunk is not its last one
    launched = runner.launch(batch)
    res = launched.result()
    assert launched.tokens.tolist() == [-1, res.next_token_ids[1]] and res.next_token_ids[0] is None
    free_reqs(runner, reqs, 0)


def _scheduler_outputs(tiny_llama_dir, overlap: bool, stream=None):
    from radixlm.srt.scheduler_process import build_scheduler

    outs: dict[str, dict] = {}

    def collect(batch) -> None:
        for o in batch.outputs:
            d = outs.setdefault(o.rid, {"ids": [], "lps": [], "tops": []})
            d["ids"].extend(o.new_token_ids)
            d["lps"].extend(o.output_token_logprobs)
            d["tops"].extend(o.output_top_logprobs)
            if o.finish_reason is not None:
                d["finish"] = o.finish_reason["type"]

    args = ServerArgs.from_kwargs(model_path=tiny_llama_dir, dtype="float32", max_total_tokens=600,
                                  max_running_requests=6, chunked_prefill_size=32, debug_check_integrity=True,
                                  schedule_conservativeness=0.05, disable_overlap_schedule=not overlap,
                                  enable_overlap_schedule=overlap)
    sched, runner = build_scheduler(args, collect)
    if stream is not None:
        runner.stream = stream
    sched.placeholder_launches = 0
    launch = runner.launch

    def counting_launch(batch, prev=None):
        sched.placeholder_launches += prev is not None
        return launch(batch, prev)

    runner.launch = counting_launch
    kinds = [{}, {"temperature": 0.8, "seed": 5}, {"repetition_penalty": 1.3},
             {"presence_penalty": 0.5, "min_new_tokens": 4}, {"temperature": 0.7, "top_p": 0.9, "seed": 9}]
    try:
        for i in range(14):
            n = 70 if i % 5 == 0 else 6 + i  # some prompts span several chunks
            sp = SamplingParams.from_dict({"max_new_tokens": 10 + 3 * (i % 4), "temperature": 0.0,
                                           **kinds[i % len(kinds)]})
            sched.add_request(TokenizedGenerateReq(rid=f"q{i}", input_ids=random_prompt(100 + i, n),
                                                   sampling_params=sp, return_logprob=i % 3 == 0,
                                                   top_logprobs_num=2 if i % 6 == 0 else 0))
        sched.run_until_idle()
        sched.check_integrity()
    finally:
        if sched.worker is not None:
            sched.worker.shutdown()
    return outs, sched


def test_scheduler_with_deferred_copies_matches_overlap_off(tiny_llama_dir):
    want, _ = _scheduler_outputs(tiny_llama_dir, overlap=False)
    stream = DeferredCopyStream()
    got, sched = _scheduler_outputs(tiny_llama_dir, overlap=True, stream=stream)
    assert {k: (v["ids"], v["finish"]) for k, v in got.items()} == \
        {k: (v["ids"], v["finish"]) for k, v in want.items()}
    # logprobs: the batches differ between the modes, so float rounding may too
    for k, v in want.items():
        assert [t for _, t in got[k]["lps"]] == [t for _, t in v["lps"]]
        assert [lp for lp, _ in got[k]["lps"]] == pytest.approx([lp for lp, _ in v["lps"]], abs=1e-4)
        assert [[t for _, t in top] for top in got[k]["tops"]] == [[t for _, t in top] for top in v["tops"]]
    assert sum(len(v["lps"]) for v in want.values()) > 0 and any(v["tops"] for v in want.values())
    assert len(want) == 14 and all(len(v["ids"]) >= 10 for v in want.values())
    assert all(e.syncs == 1 for e in stream.events)  # each result waited exactly once
    assert sched.placeholder_launches > 10  # decode batches launched on unresolved tokens
    assert sched.timer.busy_s > 0


def test_stop_path_storm_with_deferred_copies(tiny_llama_dir):
    """Aborts landing while a batch is in flight, retractions from a tight pool, a pause with
    retraction and a (same-weights) weight update, all under overlap with asynchronous host
    copies: integrity holds every step, no token is delivered twice or after the finish,
    and every output is the greedy reference or, if aborted, a prefix of it."""
    import random

    from radixlm.messages import AbortReq, UpdateWeightsFromTensorReq
    from radixlm.srt.scheduler_process import build_scheduler

    def workload():
        rng = random.Random(3)
        return [(f"s{i}", random_prompt(300 + i, rng.randrange(8, 40)), rng.randrange(60, 120)) for i in range(24)]

    def run(overlap: bool, storm: bool):
        outs: dict[str, list[int]] = {}
        finished: dict[str, str] = {}

        def collect(batch) -> None:
            for o in batch.outputs:
                assert o.rid not in finished, f"{o.rid}: output after its finish"
                outs.setdefault(o.rid, []).extend(o.new_token_ids)
                if o.finish_reason is not None:
                    finished[o.rid] = o.finish_reason["type"]

        args = ServerArgs.from_kwargs(model_path=tiny_llama_dir, dtype="float32",
                                      max_total_tokens=400 if storm else 8192, max_running_requests=12,
                                      chunked_prefill_size=32, debug_check_integrity=True,
                                      schedule_conservativeness=0.05, disable_overlap_schedule=not overlap,
                                      enable_overlap_schedule=overlap)
        sched, runner = build_scheduler(args, collect)
        sched.max_live = 0
        stream = DeferredCopyStream()
        runner.stream = stream
        rng = random.Random(9)
        try:
            for rid, prompt, n in workload():
                sp = SamplingParams.from_dict({"max_new_tokens": n, "temperature": 0.0})  # admitted optimistically
                sched.add_request(TokenizedGenerateReq(rid=rid, input_ids=prompt, sampling_params=sp))
            steps = 0
            while sched.step():
                steps += 1
                sched.max_live = max(sched.max_live, len(sched.running))
                if storm and steps % 47 == 3 and sched.running:  # a batch is in flight now (overlap)
                    sched.abort(AbortReq(rid=rng.choice(sched.running).rid))
                if storm and steps % 97 == 5 and sched.waiting:
                    sched.abort(AbortReq(rid=rng.choice(sched.waiting).rid))
                if storm and steps == 20:
                    sched.pause("retract")
                    sched.resume()
                if storm and steps == 30:  # drains the launched batch first
                    w = runner.model.model.norm.weight.detach().clone()
                    assert sched.handle(UpdateWeightsFromTensorReq(named_tensors=[("model.norm.weight", w)],
                                                                   flush_cache=False))["num_tensors"] == 1
            sched.sync()
            sched.check_integrity()
            assert sched.is_idle()
        finally:
            if sched.worker is not None:
                sched.worker.shutdown()
        assert all(e.syncs == 1 for e in stream.events)
        return outs, finished, sched.stats, sched.max_live

    want, _, _, _ = run(overlap=False, storm=False)
    got, finished, stats, max_live = run(overlap=True, storm=True)
    assert set(finished) == set(want) and stats.num_retractions > 0 and stats.num_aborted > 0
    assert stats.aborts_in_flight > 0 and max_live >= 8
    assert sum(f != "abort" for f in finished.values()) >= 8
    for rid, toks in got.items():
        if finished[rid] == "abort":
            assert toks == want[rid][:len(toks)], rid
        else:
            assert toks == want[rid], rid
