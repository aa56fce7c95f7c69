"""Overlap: an abort that arrives while batch N computes takes back the decode batch N+1
queued behind it, so the request's KV is back when N ends (abort_watch.py). Without overlap:
an abort that arrives while the next decode batch is built gives that batch back unbuilt."""
from __future__ import annotations

import threading
from concurrent.futures import Future, wait

import pytest

from radixlm.messages import AbortReq
from radixlm.scheduler.overlap import InFlight
from radixlm.scheduler.requests import Place

from test.support.fake_runner import reference_output
from test.support.scheduler_harness import Harness, make_harness

PROMPTS = {"a": [5, 6, 7], "b": [8, 9], "c": [10, 11, 12, 13]}
MAX_NEW = 12


class HeldForward:
    """Holds the forward of the next decode batch (on the forward thread) until released; the
    inbox hands its messages only while that forward is held, like an abort arriving mid-step."""

    def __init__(self) -> None:
        self.armed = False
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, batch) -> None:
        if self.armed and batch.is_decode:
            self.armed = False
            self.entered.set()
            assert self.release.wait(10), "the held forward was never released"


class ScriptedInbox:
    def __init__(self, held: HeldForward, msgs: list[object]) -> None:
        self.held, self.to_send, self.queued = held, list(msgs), []
        self.calls = 0

    def wait_for(self, future: Future) -> list[object]:
        self.calls += 1
        while not (future.done() or self.held.entered.is_set()):  # an earlier forward, or the held one
            wait([future], timeout=0.005)
        # entered and not done: `future` is the held forward's (the thread sets a result before it
        # takes the next batch)
        held_now = self.held.entered.is_set() and not future.done()
        if held_now and self.to_send:
            msgs, self.to_send = self.to_send, []
            self.queued += msgs
            return msgs
        if held_now:
            self.held.release.set()  # nothing (more) to say: let the held forward end
        wait([future], timeout=10)
        return []

    def peek(self) -> list[object]:  # the first batch after idle is launched with nothing in flight
        return []

    def take_all(self) -> list[object]:
        out, self.queued = self.queued, []
        return out


def _start(msgs: list[object]) -> tuple[Harness, HeldForward, ScriptedInbox, dict[str, object]]:
    held = HeldForward()
    inbox = ScriptedInbox(held, msgs)
    h = make_harness(enable_overlap_schedule=True, disable_overlap_schedule=False, features={"inbox": inbox})
    s = h.scheduler
    h.runner.fail_forward = held
    take_back = s._take_back

    def take_back_then_release(batch, running) -> None:  # the held forward may end once N+1 is back
        held.launches = (running.launched_at,)  # type: ignore[attr-defined]
        take_back(batch, running)
        held.release.set()
    s._take_back = take_back_then_release  # type: ignore[method-assign]
    for rid, prompt in PROMPTS.items():
        h.submit(prompt, rid=rid, max_new_tokens=MAX_NEW)
    for _ in range(4):  # prefill, then decode steps with a batch in flight
        assert s.step()
    reqs = {r.rid: r for r in s.running}
    assert set(reqs) == set(PROMPTS) and s.in_flight is not None
    held.armed = True
    for _ in range(3):  # the held batch is launched, then the one queued behind it
        s.step()
        if held.entered.is_set() and held.release.is_set():
            break
    assert held.entered.is_set() and held.release.is_set()
    return h, held, inbox, reqs


def _finish(h: Harness, inbox: ScriptedInbox) -> None:
    for msg in inbox.take_all():  # what the event loop does after the step
        h.scheduler.handle(msg)
    h.run()
    h.assert_idle_and_conserved()


def test_an_abort_during_a_forward_takes_back_the_batch_queued_behind_it():
    h, held, inbox, reqs = _start([AbortReq(rid="a")])
    s = h.scheduler
    assert s.stats.num_batches_taken_back == 1
    assert s.in_flight is None, "the queued batch is no longer in flight"
    s.check_integrity()  # its decode slots went back (live requests own exactly their KV)
    # the latest batch holding each request is again the running one, launched before the abort
    # came (what cancel latency compares with the abort's time: the KV is back when it ends)
    running_launched_at = held.launches[0]  # type: ignore[attr-defined]
    assert running_launched_at > 0 and all(r.last_launch_time == running_launched_at for r in reqs.values())
    ran = len(h.runner.forward_calls)
    for msg in inbox.take_all():
        s.handle(msg)
    a = reqs["a"]
    # nothing held it any more: ended and its KV returned when the abort was applied
    assert s.stats.aborts_running == 1 and s.stats.aborts_in_flight == 0
    assert a.req_pool_idx is None and s.requests.where(a) is None
    assert h.final("a").finish_reason["type"] == "abort"
    h.run()
    h.assert_idle_and_conserved()
    assert all(a not in b.reqs for b in h.runner.forward_calls[ran:]), "the aborted request ran again"
    got = h.tokens("a")
    assert got == reference_output(PROMPTS["a"], len(got))
    for rid in ("b", "c"):  # the survivors: every token once, as without the abort
        assert h.tokens(rid) == reference_output(PROMPTS[rid], MAX_NEW)
        assert h.final(rid).finish_reason["type"] == "length"


@pytest.mark.parametrize("msg", [AbortReq(rid="nobody"), AbortReq(rid="a", prefix=False, rids=["zz"])],
                         ids=["unknown-rid", "other-rids"])
def test_an_abort_naming_no_request_of_the_queued_batch_leaves_it_running(msg):
    h, _, inbox, _ = _start([msg])
    s = h.scheduler
    assert s.stats.num_batches_taken_back == 0 and s.in_flight is not None
    _finish(h, inbox)
    for rid in PROMPTS:
        assert h.tokens(rid) == reference_output(PROMPTS[rid], MAX_NEW)


def test_a_batch_the_forward_thread_has_started_is_not_taken_back():
    """cancel() fails once the batch runs: the abort then ends the request at that batch's end."""
    h, _, inbox, reqs = _start([])
    s = h.scheduler
    running = s.in_flight
    assert isinstance(running, InFlight)
    wait([running.future], timeout=10)
    assert not running.future.cancel()
    s.abort(AbortReq(rid="a"))
    assert s.stats.aborts_in_flight == 1 and reqs["a"].req_pool_idx is not None
    _finish(h, inbox)
    assert s.requests.where(reqs["a"]) is None and reqs["a"].req_pool_idx is None
    assert Place.RELEASING not in {s.requests.where(r) for r in reqs.values()}


class BuildTimeInbox:
    """Overlap off: the loop has read its messages; `arrive` is what comes while the next batch
    is built, seen by the scheduler's look before the launch."""

    def __init__(self) -> None:
        self.arrive: list[object] = []
        self.queued: list[object] = []

    def peek(self) -> list[object]:
        new, self.arrive = self.arrive, []
        self.queued += new
        return new

    def wait_for(self, future: Future) -> list[object]:
        raise AssertionError("without overlap the scheduler never waits on a running forward")

    def take_all(self) -> list[object]:
        out, self.queued = self.queued, []
        return out


def _start_without_overlap() -> tuple[Harness, BuildTimeInbox]:
    inbox = BuildTimeInbox()
    h = make_harness(enable_overlap_schedule=False, disable_overlap_schedule=True, features={"inbox": inbox})
    for rid, prompt in PROMPTS.items():
        h.submit(prompt, rid=rid, max_new_tokens=MAX_NEW)
    for _ in range(3):  # the prefill, then decode steps
        assert h.scheduler.step()
    return h, inbox


@pytest.mark.parametrize("abort_rid,unbuilt", [("a", 1), ("nobody", 0)])
def test_an_abort_arriving_while_a_decode_batch_is_built_gives_it_back(abort_rid, unbuilt):
    h, inbox = _start_without_overlap()
    s = h.scheduler
    reqs = {r.rid: r for r in s.running}
    ran, decoded, ratio = len(h.runner.forward_calls), s.stats.num_decode_tokens, s.ratio.value
    inbox.arrive = [AbortReq(rid=abort_rid)]
    assert s.step()
    assert s.stats.num_batches_unbuilt == unbuilt
    if unbuilt:
        assert len(h.runner.forward_calls) == ran, "the batch was launched"
        assert (s.stats.num_decode_tokens, s.ratio.value) == (decoded, ratio)
        s.check_integrity()  # the decode slots went back: live requests own exactly their KV
        for msg in inbox.take_all():  # the loop applies the abort before the next step
            s.handle(msg)
        a = reqs["a"]
        assert s.stats.aborts_running == 1 and s.stats.aborts_in_flight == 0
        assert a.req_pool_idx is None and s.requests.where(a) is None, "its KV waited for a step"
        assert h.final("a").finish_reason["type"] == "abort"
        got = h.tokens("a")
        assert got == reference_output(PROMPTS["a"], len(got))
    else:
        assert len(h.runner.forward_calls) == ran + 1
        for msg in inbox.take_all():
            s.handle(msg)
    h.run()
    h.assert_idle_and_conserved()
    assert all(reqs["a"] not in b.reqs for b in h.runner.forward_calls[ran:]) == bool(unbuilt)
    for rid in ("b", "c") if unbuilt else PROMPTS:  # every token once, as without the abort
        assert h.tokens(rid) == reference_output(PROMPTS[rid], MAX_NEW)
        assert h.final(rid).finish_reason["type"] == "length"


def test_a_batch_given_back_unbuilt_keeps_what_a_retraction_made_of_the_ratio(monkeypatch):
    """Building the batch retracted (here: a stand-in that moves the new-token ratio as a
    retraction does); giving the batch back undoes the step's decay only, not that."""
    h, inbox = _start_without_overlap()
    s = h.scheduler
    fits = iter([False])
    monkeypatch.setattr(s, "_decode_fits", lambda n, steps: next(fits, True))
    monkeypatch.setattr(s, "_ensure_decode_memory", lambda: setattr(s.ratio, "value", 0.625))
    inbox.arrive = [AbortReq(rid="b")]
    assert s.step() and s.stats.num_batches_unbuilt == 1
    assert s.ratio.value == 0.625
    for msg in inbox.take_all():
        s.handle(msg)
    h.run()
    h.assert_idle_and_conserved()
    assert h.final("b").finish_reason["type"] == "abort"
