"""Priority scheduling with preemption over the fake runner (semantics §13): queue order,
preemption as a retraction (same outputs as an uninterrupted run), the threshold, a full
queue, and a storm of priorities, aborts and preemptions on a tiny pool."""
import random

import pytest

from radixlm.messages import AbortReq
from radixlm.scheduler.requests import Place
from radixlm.srt.metrics import RuntimeMetrics

from test.support.fake_runner import FakeRunner
from test.support.scheduler_harness import make_harness

PRIO = dict(enable_priority_scheduling=True)


def _expected(prompt: list[int], n: int, vocab: int = 97) -> list[int]:
    seq, out = list(prompt), []
    for _ in range(n):
        out.append(FakeRunner.next_token(seq, vocab))
        seq.append(out[-1])
    return out


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(97) for _ in range(n)]


def _n(h, rid: str) -> int:
    return len(h.tokens(rid)) if rid in h.outputs else 0


def _step_until(h, cond, limit: int = 10_000) -> None:
    for _ in range(limit):
        if cond():
            return
        assert h.scheduler.step(), "went idle first"
        h.scheduler.check_integrity()
    raise AssertionError("condition never held")


def _finish_order(h) -> list[str]:
    done: list[str] = []
    while h.scheduler.step():
        h.scheduler.check_integrity()
        for rid, outs in h.outputs.items():
            if outs[-1].finish_reason is not None and rid not in done:
                done.append(rid)
    for rid, outs in h.outputs.items():
        if outs[-1].finish_reason is not None and rid not in done:
            done.append(rid)
    return done


def test_queue_orders_by_priority_then_arrival():
    h = make_harness(max_running=1, **PRIO)
    first = h.submit(_prompt(0, 8), max_new_tokens=2, priority=0)  # runs alone (one slot)
    _step_until(h, lambda: h.where(first) == "running")
    rids = [h.submit(_prompt(i, 8), max_new_tokens=2, priority=p) for i, p in enumerate([1, 5, 1, 5, 3], 1)]
    admitted = _finish_order(h)  # one running slot: the order of admission
    # 5 before 3 before 1 (threshold 10: nobody is preempted); arrival order within a priority
    assert admitted == [first, rids[1], rids[3], rids[4], rids[0], rids[2]]
    h.assert_idle_and_conserved()


def test_low_values_first_and_default_priority():
    h = make_harness(max_running=1, schedule_low_priority_values_first=True, default_priority=4, **PRIO)
    first = h.submit(_prompt(0, 8), max_new_tokens=2, priority=0)
    _step_until(h, lambda: h.where(first) == "running")
    late_default = h.submit(_prompt(1, 8), max_new_tokens=2)  # priority 4
    hi = h.submit(_prompt(2, 8), max_new_tokens=2, priority=2)
    lo = h.submit(_prompt(3, 8), max_new_tokens=2, priority=9)
    finished = [r for r in _finish_order(h) if r != first]
    assert finished == [hi, late_default, lo]
    h.assert_idle_and_conserved()


def test_without_the_flag_priority_is_ignored():
    h = make_harness(max_running=1)
    first = h.submit(_prompt(0, 8), max_new_tokens=2, priority=100)
    _step_until(h, lambda: h.where(first) == "running")
    a = h.submit(_prompt(1, 8), max_new_tokens=2, priority=-5)
    b = h.submit(_prompt(2, 8), max_new_tokens=2, priority=50)
    assert all(r.priority == 0 for r in h.scheduler.waiting)
    h.run()
    assert h.final(a).completion_tokens == h.final(b).completion_tokens == 2
    assert h.scheduler.stats.num_retractions == 0
    assert "priority" not in h.scheduler.get_info()


def test_preemption_for_a_running_slot_keeps_outputs_exact():
    h = make_harness(max_running=2, **PRIO)
    lows = [h.submit(_prompt(i, 12), max_new_tokens=30, priority=0) for i in range(2)]
    _step_until(h, lambda: all(h.where(r) == "running" for r in lows)
                and all(_n(h, r) >= 5 for r in lows))
    hi = h.submit(_prompt(9, 12), max_new_tokens=6, priority=20)
    h.run()
    for i, r in enumerate(lows):
        assert h.tokens(r) == _expected(_prompt(i, 12), 30)  # resumed after its preemption, exactly
    assert h.tokens(hi) == _expected(_prompt(9, 12), 6)
    assert h.scheduler.stats.num_retractions == 1  # one slot was needed: one victim
    info = h.scheduler.get_info()["priority"]
    assert info["preempted_total"] == {"0": 1}
    # the victim was the one with the least progress among equals (the retraction policy)
    assert sum(o.num_retractions > 0 for r in lows for o in h.outputs[r][-1:]) == 1
    h.assert_idle_and_conserved()


def test_threshold_and_equal_priority_never_preempt():
    for low, high, preempts in ((0, 9, False), (0, 10, True), (5, 5, False), (7, 3, False)):
        h = make_harness(max_running=1, **PRIO)
        lo = h.submit(_prompt(1, 10), max_new_tokens=20, priority=low)
        _step_until(h, lambda: _n(h, lo) >= 3)
        hi = h.submit(_prompt(2, 10), max_new_tokens=3, priority=high)
        h.run()
        assert (h.scheduler.stats.num_retractions > 0) is preempts, (low, high)
        assert h.tokens(lo) == _expected(_prompt(1, 10), 20)
        assert h.tokens(hi) == _expected(_prompt(2, 10), 3)
        h.assert_idle_and_conserved()


def test_preemption_for_kv_frees_lowest_priority_first():
    # 160 slots; three running requests of priorities 0, 1 and 30, each ~50 slots by the end
    h = make_harness(capacity=160, max_running=8, **PRIO)
    p0, p1, p30 = (h.submit(_prompt(i, 20), max_new_tokens=30, priority=p, ignore_eos=True)
                   for i, p in enumerate((0, 1, 30)))
    _step_until(h, lambda: all(_n(h, r) >= 10 for r in (p0, p1, p30)))
    hi = h.submit(_prompt(7, 60), max_new_tokens=10, priority=40, ignore_eos=True)
    _step_until(h, lambda: any(r.rid == hi for r in h.scheduler.running)
                or h.where(hi) == "running")
    retracted = {r.rid for r in h.scheduler.waiting}
    assert p30 not in retracted  # priority 30 is within the threshold of 40: never a victim
    assert p0 in retracted  # the lowest priority goes first
    h.run()
    for i, r in enumerate((p0, p1, p30)):
        assert h.tokens(r) == _expected(_prompt(i, 20), 30)
    assert h.tokens(hi) == _expected(_prompt(7, 60), 10)
    h.assert_idle_and_conserved()


def test_full_queue_turns_away_the_lowest_priority():
    h = make_harness(max_running=1, max_queued_requests=2, **PRIO)
    run = h.submit(_prompt(0, 8), max_new_tokens=3, priority=0)
    _step_until(h, lambda: h.where(run) == "running")
    q1 = h.submit(_prompt(1, 8), max_new_tokens=2, priority=3)
    q2 = h.submit(_prompt(2, 8), max_new_tokens=2, priority=1)
    lower = h.submit(_prompt(3, 8), max_new_tokens=2, priority=1)  # equal to the lowest: itself
    assert h.final(lower).finish_reason["status_code"] == 503
    higher = h.submit(_prompt(4, 8), max_new_tokens=2, priority=2)  # evicts q2
    reason = h.final(q2).finish_reason
    assert reason["status_code"] == 503 and "higher priority" in reason["message"]
    h.run()
    for rid in (run, q1, higher):
        assert h.final(rid).finish_reason["type"] != "abort"
    info = h.scheduler.get_info()
    assert info["priority"]["rejected_total"] == {"1": 2}
    text = RuntimeMetrics().render(info).decode()
    assert 'radixlm:priority_requests{priority="1",state="rejected_total"} 2.0' in text
    h.assert_idle_and_conserved()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_storm_of_priorities_aborts_and_preemptions(seed):
    """A tiny pool and few slots; mixed priorities arrive, some are aborted; integrity after
    every step; every output exact; a high-priority request finishes before any lower one
    admitted after it."""
    rng = random.Random(seed)
    h = make_harness(capacity=192, max_running=4, chunk=24, priority_scheduling_preemption_threshold=5, **PRIO)
    s = h.scheduler
    prompts, max_new, prio, aborted = {}, {}, {}, set()
    admitted_once: dict[str, int] = {}  # rid -> its retractions when last seen admitted
    step = 0
    pending = [(rng.randrange(0, 60), i) for i in range(28)]
    pending.sort()
    while pending or not s.is_idle():
        while pending and pending[0][0] <= step:
            _, i = pending.pop(0)
            prompt = _prompt(100 * seed + i, rng.randrange(4, 40))
            n = rng.randrange(1, 25)
            p = rng.choice([0, 0, 5, 10])
            rid = h.submit(prompt, rid=f"s{seed}_{i}", max_new_tokens=n, priority=p, ignore_eos=True)
            prompts[rid], max_new[rid], prio[rid] = prompt, n, p
        if step % 7 == 3 and s.waiting + s.running:
            victim = rng.choice(s.waiting + s.running)
            if rng.random() < 0.3:
                aborted.add(victim.rid)
                s.handle(AbortReq(rid=victim.rid))
        s.step()
        step += 1
        s.check_integrity()
        # admitted this step (new to prefill): nobody still waiting outranks it
        for r in s.requests.reqs(Place.PREFILL, Place.CHUNKED, Place.RUNNING):
            if r.rid not in admitted_once or r.num_retractions > admitted_once[r.rid]:
                admitted_once[r.rid] = r.num_retractions
                assert all(w.priority <= r.priority for w in s.waiting), (r.rid, r.priority)
        assert step < 20_000
    assert sum(s.get_info()["priority"]["preempted_total"].values()) > 0, "the storm should preempt"
    for rid, prompt in prompts.items():
        toks = h.tokens(rid)
        expect = _expected(prompt, max_new[rid])
        if rid in aborted:
            assert toks == expect[:len(toks)]
        else:
            assert toks == expect, rid
    h.assert_idle_and_conserved()


def test_a_high_priority_request_finishes_before_lower_ones_admitted_after_it():
    """Equal lengths, two slots, a steady stream of low-priority requests: each high one
    arriving finishes no later than any low one admitted after its arrival."""
    h = make_harness(max_running=2, **PRIO)
    s = h.scheduler
    arrival, admitted, finished = {}, {}, {}
    step, i = 0, 0
    while step < 400:
        if step % 3 == 0 and i < 40:
            p = 20 if i % 5 == 4 else 0
            rid = h.submit(_prompt(i, 10), rid=f"{'hi' if p else 'lo'}{i}", max_new_tokens=8, priority=p)
            arrival[rid], i = step, i + 1
        if not s.step() and i >= 40:
            break
        step += 1
        s.check_integrity()
        for r in s.requests.reqs(Place.PREFILL, Place.RUNNING):
            admitted.setdefault(r.rid, step)
        for rid, outs in h.outputs.items():
            if outs[-1].finish_reason is not None:
                finished.setdefault(rid, step)
    his = [r for r in arrival if r.startswith("hi")]
    assert len(his) == 8 and s.stats.num_retractions > 0
    for hi in his:
        for lo in (r for r in arrival if r.startswith("lo") and admitted[r] > arrival[hi]):
            assert finished[hi] <= finished[lo], (hi, lo)
    for rid in arrival:
        assert h.tokens(rid) == _expected(_prompt(int(rid[2:]), 10), 8)
    h.assert_idle_and_conserved()
