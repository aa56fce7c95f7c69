"""Speculation inside the scheduler, over the KV-checking fake model: outputs equal plain
decoding, drafts stop where a finish lands inside an accepted run, and no draft slot outlives
its step on any stop path (abort, retraction, pause, errors), with check_integrity and
kv_allocated_len == kv_committed_len after every step.

memory=1 makes the fake's next token a function of the last token alone (vocab 13), so the
text cycles and drafts get accepted; memory=None (the whole sequence) makes drafts fail.
"""
from __future__ import annotations

import dataclasses
import random

import pytest

from radixlm.config import ServerArgs
from radixlm.messages import AbortReq
from radixlm.scheduler.config import SchedulerConfig
from radixlm.scheduler.output import StopStringChecker
from radixlm.scheduler.scheduler import Scheduler
from radixlm.speculative.drafter import NgramConfig

from test.support.fake_runner import reference_output
from test.support.spec_harness import assert_no_draft_slots, make_spec_harness, run_checked

V = 13


def _prompt(n: int, seed: int, vocab: int = V) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


def _spec(h) -> dict:
    return {k: v for k, v in h.scheduler.get_info().items() if k.startswith("spec")}


@pytest.mark.parametrize("memory", [1, None], ids=["repeating", "not-repeating"])
def test_outputs_equal_plain_decoding(memory):
    h = make_spec_harness(vocab=V, memory=memory)
    prompts = [_prompt(3 + i, i) for i in range(6)]
    rids = [h.submit(p, max_new_tokens=30 + 7 * i) for i, p in enumerate(prompts)]
    run_checked(h)
    for i, (rid, p) in enumerate(zip(rids, prompts, strict=True)):
        assert h.tokens(rid) == reference_output(p, 30 + 7 * i, V, memory)
        fin = h.final(rid)
        assert fin.spec_verify_ct is not None and fin.spec_verify_ct < len(h.tokens(rid))
    spec = _spec(h)
    if memory == 1:
        assert spec["spec_accepted_tokens"] > 50 and spec["spec_accept_length"] > 2
    else:  # drafts mostly fail here: the adaptive rule keeps them short (well under 1 per row-step)
        assert spec["spec_accept_rate"] < 0.3
        assert 0 < spec["spec_draft_tokens"] < spec["spec_verify_rows"]
    h.assert_idle_and_conserved()


def test_second_request_drafts_from_the_index_and_max_new_tokens_is_exact():
    h = make_spec_harness(vocab=97)  # whole-sequence model: only the index can predict it
    p = _prompt(12, 5, 97)
    first = h.submit(p, max_new_tokens=40)
    run_checked(h)
    for n in (1, 2, 9, 17, 40):
        rid = h.submit(p, max_new_tokens=n)
        run_checked(h)
        assert h.tokens(rid) == reference_output(p, n, 97) == h.tokens(first)[:n]
        if n > 9:
            assert h.final(rid).spec_accepted_tokens >= n - 1 - h.final(rid).spec_verify_ct
    h.assert_idle_and_conserved()


def test_eos_inside_an_accepted_run_ends_there():
    """Every token of the output tried as the EOS: the request ends at its first occurrence,
    and for some of them that lands inside an accepted run (the rest of the run is dropped)."""
    p = _prompt(4, 9)
    ref = reference_output(p, 60, V, 1)
    cuts = 0
    for eos in sorted(set(ref)):
        h = make_spec_harness(vocab=V, memory=1, eos=(eos,))
        warm = h.submit(p, max_new_tokens=60, ignore_eos=True)
        run_checked(h)
        rid = h.submit(p, max_new_tokens=60)
        run_checked(h)
        assert h.tokens(warm) == ref
        assert h.tokens(rid) == ref[:ref.index(eos) + 1]
        assert h.final(rid).finish_reason == {"type": "stop", "matched": eos}
        cuts += _spec(h)["spec_cut_runs"]
        h.assert_idle_and_conserved()
    assert cuts >= 1


class _SpaceTokenizer:
    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(f"<{t}>" for t in token_ids)


def test_stop_string_inside_an_accepted_run_ends_there():
    p = _prompt(4, 11)
    ref = reference_output(p, 60, V, 1)
    stop = f"<{ref[20]}><{ref[21]}>"
    first = next(j for j in range(1, 60) if f"<{ref[j - 1]}><{ref[j]}>" == stop)
    h = make_spec_harness(vocab=V, memory=1)
    h.scheduler.stop_checker = StopStringChecker(_SpaceTokenizer())
    h.submit(p, max_new_tokens=60)
    run_checked(h)
    cuts = _spec(h)["spec_cut_runs"]
    rid = h.submit(p, max_new_tokens=60, stop=[stop])
    run_checked(h)
    assert h.tokens(rid) == ref[:first + 1]  # the scheduler keeps the stop string's tokens (detokenizer trims)
    assert h.final(rid).finish_reason == {"type": "stop", "matched": stop}
    assert _spec(h)["spec_cut_runs"] > cuts
    h.assert_idle_and_conserved()


def test_logprobs_of_accepted_tokens_are_delivered():
    h = make_spec_harness(vocab=V, memory=1)
    p = _prompt(5, 3)
    h.submit(p, max_new_tokens=40)
    run_checked(h)
    from radixlm.messages import TokenizedGenerateReq
    from radixlm.sampling_params import SamplingParams
    h.scheduler.add_request(TokenizedGenerateReq(rid="lp", input_ids=p, return_logprob=True, top_logprobs_num=1,
                                                 sampling_params=SamplingParams.from_dict({"max_new_tokens": 40})))
    run_checked(h)
    toks = h.tokens("lp")
    lps = [x for o in h.outputs["lp"] for x in o.output_token_logprobs]
    tops = [x for o in h.outputs["lp"] for x in o.output_top_logprobs]
    assert [t for _, t in lps] == toks and len(tops) == len(toks) == 40
    assert h.final("lp").spec_accepted_tokens > 20


def test_a_row_ended_during_its_step_delivers_nothing_of_it():
    """to_finish set while the step runs (what the error boundary does to a failed row):
    none of the row's emitted tokens is delivered and all its step's slots are freed."""
    h = make_spec_harness(vocab=V, memory=1)
    p = _prompt(4, 2)
    h.submit(p, max_new_tokens=50)
    run_checked(h)
    victim = h.submit(p, max_new_tokens=50, stream=True)
    seen: dict = {}

    def end_victim(batch):
        if batch.drafts is not None and any(batch.drafts) and not seen:
            req = batch.reqs[0]
            seen["len"] = len(req.output_ids)
            from radixlm.core import FinishReason
            req.to_finish = FinishReason.abort("ended during the step")

    h.runner.fail_forward = end_victim
    run_checked(h)
    assert seen, "no speculative step ran"
    assert len(h.tokens(victim)) == seen["len"]
    assert h.final(victim).finish_reason["type"] == "abort"
    assert _spec(h)["spec_dropped_steps"] == 1
    h.assert_idle_and_conserved()


def test_failed_speculative_forward_is_replayed_row_by_row():
    h = make_spec_harness(vocab=V, memory=1)
    prompts = [_prompt(4, 20 + i) for i in range(3)]
    for p in prompts:
        h.submit(p, max_new_tokens=40)
    run_checked(h)
    rids = [h.submit(p, max_new_tokens=40) for p in prompts]
    failed = []

    def fail_once(batch):
        if len(batch.reqs) > 1 and batch.has_drafts and not failed:
            failed.append(1)
            raise RuntimeError("injected")

    h.runner.fail_forward = fail_once
    run_checked(h)
    assert failed and h.scheduler.stats.num_batch_replays == 1
    for rid, p in zip(rids, prompts, strict=True):
        assert h.tokens(rid) == reference_output(p, 40, V, 1)
    h.assert_idle_and_conserved()


def test_drafts_never_cause_a_retraction():
    """With room for every row's decode slot and 3 more, the full-length drafts are cut to 3
    tokens in all, and nobody is retracted."""
    prompts = [reference_output(_prompt(4, 40 + i), 20, V, 1) for i in range(8)]  # in the cycle: long drafts
    h = make_spec_harness(vocab=V, memory=1, disable_cache=True)
    s = h.scheduler
    rids = [h.submit(p, max_new_tokens=30) for p in prompts]
    for _ in range(4):
        s.step()
    assert len(s.running) == 8 and _spec(h)["spec_draft_tokens"] > 0
    taken = h.cache.allocator.alloc(h.cache.available() - 8 - 3)  # the rest of the pool is someone else's
    drafted, dropped = _spec(h)["spec_draft_tokens"], _spec(h)["spec_dropped_for_memory"]
    checked, s.config = s.config, dataclasses.replace(s.config, debug_check_integrity=False)  # slots taken
    s.step()
    s.config = checked
    assert s.stats.num_retractions == 0
    assert _spec(h)["spec_draft_tokens"] - drafted == 3 and _spec(h)["spec_dropped_for_memory"] > dropped
    assert_no_draft_slots(s)
    h.cache.allocator.free(taken)
    run_checked(h)
    for rid, p in zip(rids, prompts, strict=True):
        assert h.tokens(rid) == reference_output(p, 30, V, 1)
    h.assert_idle_and_conserved()


@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
def test_pause_modes_with_speculation(mode):
    h = make_spec_harness(vocab=V, memory=1)
    prompts = [_prompt(5, 60 + i) for i in range(3)]
    rids = [h.submit(p, max_new_tokens=40, stream=True) for p in prompts]
    for _ in range(6):
        h.scheduler.step()
        assert_no_draft_slots(h.scheduler)
    h.scheduler.pause(mode)
    assert_no_draft_slots(h.scheduler)
    h.scheduler.check_integrity()
    h.scheduler.resume()
    run_checked(h)
    for rid, p in zip(rids, prompts, strict=True):
        toks = h.tokens(rid)
        assert toks == reference_output(p, 40, V, 1)[:len(toks)]
        if mode != "abort":
            assert len(toks) == 40
    h.assert_idle_and_conserved()


@pytest.mark.parametrize("memory", [1, None], ids=["repeating", "not-repeating"])
def test_storm_of_aborts_retractions_and_pauses(memory):
    rng = random.Random(17)
    h = make_spec_harness(vocab=V, memory=memory, capacity=220, max_running=16, chunk=16,
                          schedule_conservativeness=0.3)
    s = h.scheduler
    expect: dict[str, list[int]] = {}
    live: list[str] = []
    for i in range(160):
        p = _prompt(rng.randrange(3, 30), 500 + i)
        n = rng.randrange(1, 50)
        rid = h.submit(p, rid=f"s{i}", max_new_tokens=n, stream=bool(i % 2))
        expect[rid] = reference_output(p, n, V, memory)
        live.append(rid)
        for _ in range(rng.randrange(0, 4)):
            s.step()
            s.check_integrity()
            assert_no_draft_slots(s)
        roll = rng.random()
        if roll < 0.15:
            s.abort(AbortReq(rid=rng.choice(live)))
        elif roll < 0.17:
            s.pause(rng.choice(["retract", "in_place"]))
            assert_no_draft_slots(s)
            s.resume()
        elif roll < 0.175:
            s.abort(AbortReq(abort_all=True))
        s.check_integrity()
    run_checked(h)
    assert s.stats.num_retractions > 0
    aborted = 0
    for rid, ref in expect.items():
        fin = h.final(rid)  # exactly one terminal output, and nothing after it
        toks = h.tokens(rid)
        assert toks == ref[:len(toks)], rid
        if fin.finish_reason["type"] == "abort":
            aborted += 1
        else:
            assert toks == ref, rid
    assert aborted > 5
    if memory == 1:
        assert _spec(h)["spec_accepted_tokens"] > 100
    h.assert_idle_and_conserved()


def test_flush_cache_and_weight_updates_flush_the_index():
    from radixlm.messages import UpdateWeightsFromTensorReq

    h = make_spec_harness(vocab=V, memory=1)
    h.submit(_prompt(4, 1), max_new_tokens=20)
    run_checked(h)
    assert _spec(h)["spec_index_entries"] > 0
    assert h.scheduler.flush_cache()
    assert _spec(h)["spec_index_entries"] == 0
    h.submit(_prompt(4, 2), max_new_tokens=20)
    run_checked(h)
    assert _spec(h)["spec_index_entries"] > 0
    h.runner.update_weights_from_tensor = lambda named: len(named)  # the fake has no weights to change
    h.scheduler.handle(UpdateWeightsFromTensorReq(named_tensors=[], flush_cache=False, cache_namespace="v1"))
    assert _spec(h)["spec_index_entries"] == 0


def test_speculation_refuses_what_it_cannot_run():
    base = {"speculative_algorithm": "ngram"}
    for bad, word in [({"enable_overlap_schedule": True}, "overlap"), ({"tp_size": 2}, "tp_size"),
                      ({"disaggregation_mode": "decode"}, "disaggregation_mode"),
                      ({"attention_backend": "torch_native"}, "cpu"), ({"device": "cuda"}, "CPU"),
                      ({"speculative_num_draft_tokens": -1}, "speculative_num_draft_tokens"),
                      ({"speculative_ngram_min_match_window_size": 5,
                        "speculative_ngram_max_match_window_size": 2}, "window"),
                      ({"speculative_algorithm": "eagle"}, "speculative_algorithm")]:
        with pytest.raises(ValueError, match=word):
            ServerArgs.from_kwargs(**{**base, **bad})
    ok = ServerArgs.from_kwargs(**base, speculative_num_draft_tokens=4, speculative_ngram_capacity=0)
    assert ok.ngram_config() == NgramConfig(num_draft_tokens=4, capacity=0)
    h = make_spec_harness()
    with pytest.raises(ValueError, match="overlap"):
        Scheduler(SchedulerConfig(max_running_requests=4, chunked_prefill_size=None, overlap=True,
                                  speculative=NgramConfig()), h.runner, h.cache)


@pytest.mark.parametrize("spec", ["mod=3,len=12", "mod=2,len=40"], ids=["grammar-ends-first", "length-first"])
def test_grammar_rows_draft_within_their_grammar(spec):
    """A grammar row drafts from the index like any row; its drafts are cut at the grammar (and
    before the token that completes it), the matcher is rolled back, and the output is exactly
    the constrained one, beside unconstrained drafted rows."""
    from test.support.fake_grammar import FakeGrammarBackend, constrained_reference
    h = make_spec_harness(vocab=97, grammar_backend=FakeGrammarBackend())
    p, gp = _prompt(8, 4, 97), _prompt(9, 5, 97)
    want, kind = constrained_reference(gp, spec, 30)
    first = h.submit(p, max_new_tokens=30)
    g1 = h.submit(gp, max_new_tokens=30, regex=spec)
    run_checked(h)
    g2 = h.submit(gp, max_new_tokens=30, regex=spec)  # drafts from g1's output in the index
    again = h.submit(p, max_new_tokens=30)
    run_checked(h)
    for g in (g1, g2):
        assert h.tokens(g) == want and h.final(g).finish_reason["type"] == kind
    assert h.final(g2).spec_accepted_tokens >= len(want) // 2
    assert h.tokens(again) == h.tokens(first) and h.final(again).spec_accepted_tokens > 10
    h.assert_idle_and_conserved()


def test_counters_reach_metrics_and_meta_info():
    from radixlm.srt.metrics import RuntimeMetrics
    from radixlm.srt.results import spec_meta

    h = make_spec_harness(vocab=V, memory=1)
    rid = h.submit(_prompt(4, 8), max_new_tokens=40)
    run_checked(h)
    info = h.scheduler.get_info()
    text = RuntimeMetrics().render(info).decode()
    assert f"radixlm:spec_accepted_tokens_total {float(info['spec_accepted_tokens'])}" in text
    assert "radixlm:spec_accept_rate " in text and "sglang:spec_accept_length{" in text
    fin = h.final(rid)
    meta = spec_meta(fin.spec_verify_ct, fin.spec_draft_tokens, fin.spec_accepted_tokens)
    # emitted tokens per verify step: every decode token came from a verify step (the first from the prefill)
    assert meta["spec_accept_length"] == round((fin.completion_tokens - 1) / fin.spec_verify_ct, 4)
    assert 0 < meta["spec_accept_rate"] <= 1 and meta["spec_verify_ct"] == fin.spec_verify_ct


def test_a_replayed_row_keeps_its_drafts_and_grammar_masks():
    import torch

    from radixlm.scheduler.batch import WorkerBatch
    from radixlm.scheduler.error_boundary import _row

    h = make_spec_harness()
    a = h.submit([1, 2, 3], max_new_tokens=4)
    b = h.submit([4, 5, 6], max_new_tokens=4)
    ra, rb = (next(r for r in h.scheduler.waiting if r.rid == x) for x in (a, b))
    masks = torch.arange(5 * 4, dtype=torch.int32).reshape(5, 4)
    batch = WorkerBatch(mode="decode", reqs=[ra, rb], input_ids=[3, 7, 8, 6, 9], out_cache_loc=torch.arange(5),
                        prefix_lens=[2, 2], extend_lens=[3, 2], sample=[True, True], drafts=[[7, 8], [9]],
                        draft_bitmask=masks, draft_mask_rows=[3, 4])
    one = _row(batch, 1, 3)
    assert one.drafts == [[9]] and one.draft_mask_rows == [0, 1] and torch.equal(one.draft_bitmask, masks[3:5])
    other = _row(batch, 0, 0)
    assert other.drafts == [[7, 8]] and other.draft_bitmask is None and other.draft_mask_rows == []
