"""The stop path at the scheduler: every state × abort, timeouts, queue limits, pause, and a
random storm, with the KV-checking fake model and check_integrity after every step."""
from __future__ import annotations

import random
import time

import pytest

from radixlm.messages import AbortReq
from radixlm.scheduler.requests import Place

from test.support.fake_runner import reference_output
from test.support.scheduler_harness import make_harness


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(97) for _ in range(n)]


def _drive_to(h, rid, state: str, max_steps: int = 200) -> None:
    sched = h.scheduler
    for _ in range(max_steps):
        if h.where(rid) == state:
            req = next(r for r in sched.live_reqs() + sched.waiting if r.rid == rid)
            if state != "running" or req.output_ids:
                return
        sched.step()
        sched.check_integrity()
    raise AssertionError(f"{rid} never reached {state}")


@pytest.mark.parametrize("state", ["waiting", "chunked", "running", "retracted", "finished", "unknown"])
def test_abort_matrix(state):
    h = make_harness(capacity=200 if state == "retracted" else 2048, max_running=8, chunk=8)
    prompt = _prompt(30 if state == "chunked" else 12, 1)
    others = [h.submit(_prompt(12, 10 + i), max_new_tokens=60 if state == "retracted" else 4)
              for i in range(4 if state == "retracted" else 1)]
    rid = h.submit(prompt, max_new_tokens=60 if state == "retracted" else 30, stream=True)
    if state in ("chunked", "running"):
        _drive_to(h, rid, state)
    elif state == "retracted":
        for _ in range(400):
            req = next((r for r in h.scheduler.waiting if r.num_retractions), None)
            if req is not None:
                break
            h.scheduler.step()
        assert req is not None and req.output_ids, "no request was retracted"
        if req.rid != rid:  # abort the retracted one; the one we submitted becomes an "other"
            others.append(rid)
            others.remove(req.rid)
            rid, prompt = req.rid, req.origin_input_ids
    elif state == "finished":
        h.run()
    before = len(h.outputs.get(rid, []))
    h.scheduler.abort(AbortReq(rid="nope" if state == "unknown" else rid))
    h.run()
    fin = h.final(rid)
    if state in ("finished", "unknown"):
        assert fin.finish_reason["type"] == "length"
        if state == "finished":
            assert len(h.outputs[rid]) == before  # nothing after the terminal output
    else:
        assert fin.finish_reason["type"] == "abort" and fin.finish_reason["status_code"] == 200
        toks = h.tokens(rid)
        assert toks == reference_output(prompt, 60 if state == "retracted" else 30)[:len(toks)]
        if state == "retracted":
            assert toks, "partial output from before the retraction is delivered"
    for o in others:
        h.final(o)
    h.assert_idle_and_conserved()


def test_abort_in_launched_batch_drops_the_step_token(schedule_mode):
    """Simulate an abort landing while a decode batch is in flight (by hand, normal loop)."""
    if schedule_mode == "overlap":
        pytest.skip("the overlap loop has its own version below")
    h = make_harness()
    rid = h.submit(_prompt(10, 2), max_new_tokens=30, stream=True)
    _drive_to(h, rid, "running")
    sched = h.scheduler
    batch = sched.schedule()
    req = batch.reqs[0]
    sched.in_flight_reqs = lambda: {id(req)}  # the batch is launched
    sched.abort(AbortReq(rid=rid))
    assert req.to_finish is not None and req in sched.running
    del sched.in_flight_reqs
    delivered = len(h.tokens(rid))
    result = h.runner.forward(batch)
    sched.process_decode_result(batch, result)
    sched.flush()
    assert h.final(rid).finish_reason["type"] == "abort"
    assert len(h.tokens(rid)) == delivered  # the in-flight step's token is not delivered
    h.assert_idle_and_conserved()


def test_overlap_abort_of_an_in_flight_request(schedule_mode):
    if schedule_mode == "normal":
        pytest.skip("only the overlap loop has a batch in flight between iterations")
    h = make_harness()
    rid = h.submit(_prompt(10, 2), max_new_tokens=30, stream=True)
    sched = h.scheduler
    while not (sched.in_flight is not None and sched.in_flight.batch.is_decode
               and any(r.rid == rid for r in sched.in_flight.batch.reqs)):
        sched.step()
    req = next(r for r in sched.in_flight.batch.reqs if r.rid == rid)
    delivered = len(h.tokens(rid))
    sched.abort(AbortReq(rid=rid))
    assert req.to_finish is not None and req.req_pool_idx is not None  # KV kept while in flight
    h.run()
    assert h.final(rid).finish_reason["type"] == "abort"
    assert len(h.tokens(rid)) == delivered  # the in-flight step's token is not delivered
    h.assert_idle_and_conserved()


def test_overlap_finish_in_flight_defers_release():
    """A request that hits EOS in batch N is already in batch N+1: its KV is released only
    after N+1 resolves, and N+1's token for it is never delivered."""
    p = _prompt(10, 40)
    ref = reference_output(p, 30)
    h = make_harness(eos=(ref[4],), disable_overlap_schedule=False, enable_overlap_schedule=True)
    rid = h.submit(p, max_new_tokens=30)
    released_early = []
    sched = h.scheduler
    while sched.step():
        req = sched.requests.first(Place.RELEASING)  # finished, its KV still written by a launched batch
        if req is not None:
            released_early.append(req.req_pool_idx is not None)
    assert released_early and all(released_early)
    assert h.tokens(rid) == ref[:5]
    h.assert_idle_and_conserved()


def test_chunked_prefill_abort_keeps_computed_chunks_in_tree():
    h = make_harness(chunk=16)
    prompt = _prompt(64, 3)
    rid = h.submit(prompt, max_new_tokens=5)
    h.scheduler.step()
    h.scheduler.step()  # two chunks launched (the second may still be in flight)
    assert h.where(rid) == "chunked"
    h.scheduler.abort(AbortReq(rid=rid))
    h.run()
    assert h.final(rid).finish_reason["type"] == "abort"
    assert h.cache.evictable() == 32
    computed = h.runner.tokens_computed
    again = h.submit(prompt, max_new_tokens=5)
    h.run()
    assert h.final(again).cached_tokens == 32
    assert h.runner.tokens_computed - computed == 32 + 4  # the rest + decode steps
    h.assert_idle_and_conserved()


def test_per_request_timeout_and_waiting_timeout_are_503():
    h = make_harness(max_running=1, request_waiting_timeout=0.05)
    first = h.submit(_prompt(10, 4), max_new_tokens=400)
    h.scheduler.step()
    queued = h.submit(_prompt(10, 5), max_new_tokens=4)
    time.sleep(0.08)
    h.scheduler.step()
    fr = h.final(queued).finish_reason
    assert fr["type"] == "abort" and fr["status_code"] == 503 and "waited" in fr["message"]
    h.scheduler.abort(AbortReq(rid=first))
    h.run()
    h2 = make_harness()
    h2.scheduler.add_request(__import__("radixlm.messages", fromlist=["x"]).TokenizedGenerateReq(
        rid="t", input_ids=_prompt(8, 6), sampling_params=__import__(
            "radixlm.sampling_params", fromlist=["x"]).SamplingParams(max_new_tokens=10_000, ignore_eos=True),
        timeout=0.05))
    t0 = time.perf_counter()
    h2.run()
    fr = h2.final("t").finish_reason
    assert fr["status_code"] == 503 and "timed out" in fr["message"]
    assert time.perf_counter() - t0 < 5
    assert h2.tokens("t"), "partial output delivered with the timeout"
    h.assert_idle_and_conserved()
    h2.assert_idle_and_conserved()


def test_running_timeout_and_queue_limit():
    h = make_harness(request_running_timeout=0.05, max_queued_requests=2)
    rids = [h.submit(_prompt(8, 20 + i), max_new_tokens=10_000, ignore_eos=True) for i in range(3)]
    rejected = h.final(rids[2]).finish_reason
    assert rejected["status_code"] == 503 and "queue is full" in rejected["message"]
    h.run()
    for r in rids[:2]:
        fr = h.final(r).finish_reason
        assert fr["status_code"] == 503 and "ran longer" in fr["message"]
    h.assert_idle_and_conserved()


@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
def test_pause_modes(mode):
    h = make_harness()
    prompts = [_prompt(10, 30 + i) for i in range(3)]
    rids = [h.submit(p, max_new_tokens=20, stream=True) for p in prompts]
    for _ in range(5):
        h.scheduler.step()
    h.scheduler.pause(mode)
    assert h.scheduler.step() is False  # nothing runs while paused
    if mode == "abort":
        assert all(h.final(r).finish_reason["type"] == "abort" for r in rids)
    elif mode == "retract":
        assert not h.scheduler.running and len(h.scheduler.waiting) == 3
        assert h.cache.protected() == 0
        assert h.scheduler.flush_cache() is False  # requests still pending
    else:
        assert len(h.scheduler.running) == 3
    h.scheduler.resume()
    h.run()
    if mode != "abort":
        for r, p in zip(rids, prompts):
            assert h.tokens(r) == reference_output(p, 20)
    h.assert_idle_and_conserved()


def test_storm_of_random_aborts_with_retractions_and_families():
    rng = random.Random(7)
    h = make_harness(capacity=150, max_running=16, chunk=16, schedule_conservativeness=0.3)
    expect: dict[str, list[int]] = {}
    live: list[str] = []
    for i in range(220):
        p = _prompt(rng.randrange(4, 40), 1000 + i)
        n = rng.randrange(1, 60)
        rid = f"s{i}"
        family = rng.random() < 0.1
        if family:
            for c in range(3):
                h.submit(p, rid=f"{rid}_{c}", max_new_tokens=n, stream=True)
                expect[f"{rid}_{c}"] = reference_output(p, n)
                live.append(f"{rid}_{c}")
        else:
            h.submit(p, rid=rid, max_new_tokens=n, stream=bool(i % 2))
            expect[rid] = reference_output(p, n)
            live.append(rid)
        for _ in range(rng.randrange(0, 3)):
            h.scheduler.step()
        roll = rng.random()
        if roll < 0.15 and live:
            h.scheduler.abort(AbortReq(rid=rng.choice(live)))
        elif roll < 0.18 and family:  # the whole family, as the front end names it: its exact rids
            h.scheduler.abort(AbortReq(rids=[f"{rid}_{c}" for c in range(3)]))
        elif roll < 0.185:
            h.scheduler.abort(AbortReq(abort_all=True))
    h.run()
    assert h.scheduler.stats.num_retractions > 0
    aborted = 0
    for rid, ref in expect.items():
        fin = h.final(rid)
        toks = h.tokens(rid)
        assert toks == ref[:len(toks)], rid  # no token twice, none out of order
        if fin.finish_reason["type"] == "abort":
            aborted += 1
        else:
            assert toks == ref, rid  # survivors are exactly the undisturbed output
    assert aborted > 10
    h.assert_idle_and_conserved()
