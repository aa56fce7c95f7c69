"""Sessions over the fake runner (semantics §14): turns continue from the KV their session holds
(with the prefix cache off, so no tree match can supply it), SGLang's session_params, aborts,
limits, and every way the held KV goes back, integrity after every step. The fake runner
checks every KV slot a forward reads holds the request's own token, so KV handed over from
the wrong turn, or at the wrong length, fails loudly."""
import random

import pytest

from radixlm.messages import AbortReq, SessionParams
from radixlm.scheduler.requests import Place

from test.support.fake_runner import FakeRunner
from test.support.scheduler_harness import make_harness
from test.support.spec_harness import make_spec_harness, run_checked


def _expected(prompt: list[int], n: int, vocab: int = 97, memory: int | None = None) -> list[int]:
    seq, out = list(prompt), []
    for _ in range(n):
        window = seq if memory is None else seq[-memory:]
        out.append(FakeRunner.next_token(window, vocab))
        seq.append(out[-1])
    return out


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(97) for _ in range(n)]


def _turn(h, sid, input_ids, name, n=8, **params):
    h.submit(input_ids, rid=name, max_new_tokens=n, ignore_eos=True, session=SessionParams(sid, **params))
    return name


def _held(h) -> list:
    return h.scheduler.sessions.held_reqs()


def _open(h, capacity=400, timeout=None) -> str:
    return h.scheduler.open_session(capacity, timeout, None)


@pytest.mark.parametrize("cache", ["radix", "none"])
def test_turns_continue_from_the_session_kv(cache):
    h = make_harness(disable_cache=cache == "none")
    sid = _open(h)
    p1, p2, p3 = _prompt(1, 12), _prompt(2, 5), _prompt(3, 4)
    t1 = _turn(h, sid, p1, "t1")
    h.run()
    full1 = p1 + _expected(p1, 8)
    assert h.tokens(t1) == full1[12:]
    (held,) = _held(h)
    assert held.rid == "t1" and held.kv_allocated_len == held.kv_committed_len == len(full1) - 1
    t2 = _turn(h, sid, p2, "t2", rid="t1")
    h.run()
    full2 = full1 + p2
    assert h.tokens(t2) == _expected(full2, 8)
    # the whole history came from the session: with the cache off nothing else could give it
    assert h.final(t2).cached_tokens == len(full1) - 1
    t3 = _turn(h, sid, p3, "t3", rid="t2")
    h.run()
    full3 = full2 + h.tokens(t2) + p3
    assert h.tokens(t3) == _expected(full3, 8)
    assert h.final(t3).cached_tokens == len(full2) + 8 - 1
    assert [r.rid for r in _held(h)] == ["t3"]
    assert h.scheduler.get_info()["sessions"]["turns_from_held_kv"] == 2
    h.scheduler.close_session(sid)
    assert not _held(h)
    h.assert_idle_and_conserved()


def test_offset_drop_previous_output_branch_and_replace():
    h = make_harness(disable_cache=True)
    sid = _open(h)
    p1 = _prompt(4, 10)
    _turn(h, sid, p1, "a")
    h.run()
    out_a = h.tokens("a")
    # drop_previous_output: a's prompt, then the input
    _turn(h, sid, [5, 6], "b", rid="a", drop_previous_output=True)
    h.run()
    assert h.tokens("b") == _expected(p1 + [5, 6], 8)
    # offset: the first 7 tokens of a's prompt + output
    _turn(h, sid, [9], "c", rid="a", offset=7)
    h.run()
    assert h.tokens("c") == _expected(p1[:7] + [9], 8)
    # a branch from a (not held: c's KV is) recomputes through the cache as usual
    _turn(h, sid, [1, 2], "d", rid="a")
    h.run()
    assert h.tokens("d") == _expected(p1 + out_a + [1, 2], 8)
    # replace: the turns after a leave the history
    _turn(h, sid, [3], "e", rid="a", replace=True)
    h.run()
    assert h.tokens("e") == _expected(p1 + out_a + [3], 8)
    turns = h.scheduler.sessions.sessions[sid].turns
    assert sorted(turns) == ["a", "e"]
    _turn(h, sid, [3], "f", rid="c")  # a turn that left the history
    assert h.final("f").finish_reason["status_code"] == 400
    h.scheduler.close_session(sid)
    h.assert_idle_and_conserved()


@pytest.mark.parametrize("stream", [False, True])
def test_abort_mid_turn_leaves_the_session_exact(stream):
    h = make_harness(disable_cache=True)
    s = h.scheduler
    sid = _open(h)
    p1 = _prompt(6, 9)
    _turn(h, sid, p1, "t1")
    h.run()
    full1 = p1 + h.tokens("t1")
    h.submit([7, 7], rid="t2", max_new_tokens=50, ignore_eos=True, stream=stream,
             session=SessionParams(sid, rid="t1"))
    for _ in range(6):
        s.step()
        s.check_integrity()
    assert any(r.rid == "t2" for r in s.requests.reqs(Place.RUNNING, Place.PREFILL))
    s.handle(AbortReq(rid="t2"))
    h.run()
    assert h.final("t2").finish_reason["type"] == "abort"
    assert sorted(s.sessions.sessions[sid].turns) == ["t1"]  # the aborted turn is no history
    _turn(h, sid, [8], "t3", rid="t1")
    h.run()
    assert h.tokens("t3") == _expected(full1 + [8], 8)
    _turn(h, sid, [8], "t4", rid="t2")
    assert h.final("t4").finish_reason["status_code"] == 400
    s.close_session(sid)
    h.assert_idle_and_conserved()


def test_limits_leave_the_session_untouched():
    h = make_harness(disable_cache=True, context=64)
    s = h.scheduler
    sid = _open(h, capacity=40)
    p1 = _prompt(8, 20)
    _turn(h, sid, p1, "t1")
    h.run()
    (held,) = _held(h)
    before = (dict(s.sessions.sessions[sid].turns), held.kv_allocated_len)
    _turn(h, sid, _prompt(9, 40), "long", rid="t1")  # over the context window: 400
    assert h.final("long").finish_reason["status_code"] == 400
    _turn(h, sid, _prompt(9, 15), "big", rid="t1")  # 43 tokens > capacity 40: 400
    assert h.final("big").finish_reason["status_code"] == 400
    _turn(h, sid, _prompt(9, 15), "big2", rid="t1", replace=True)  # refused: replace changes nothing
    assert h.final("big2").finish_reason["status_code"] == 400
    assert (dict(s.sessions.sessions[sid].turns), _held(h)[0].kv_allocated_len) == before
    _turn(h, "nope", [1], "x")
    assert "not open" in h.final("x").finish_reason["message"]
    # a turn whose KV would exceed the capacity is history, but its KV is not held
    _turn(h, sid, [1], "t2", rid="t1", n=15)
    h.run()
    assert "t2" in s.sessions.sessions[sid].turns and not _held(h)
    assert not s.sessions.sessions[sid].in_flight  # refused turns left nothing behind
    s.close_session(sid)
    h.assert_idle_and_conserved()


@pytest.mark.parametrize("how", ["close", "timeout", "flush", "weights", "abort_all", "retract"])
def test_session_kv_goes_back_once(how):
    h = make_harness()
    s = h.scheduler
    clock = [0.0]
    s.ranks = type("Clock", (), {"now": staticmethod(lambda: clock[0])})()
    sid = s.open_session(400, 5.0, "s1")
    p1 = _prompt(10, 10)
    _turn(h, sid, p1, "t1")
    h.run()
    assert _held(h)
    # a turn in flight continuing from the held KV, and the held KV of a second session
    other = s.open_session(400, None, "s2")
    _turn(h, other, _prompt(11, 6), "o1")
    h.run()
    _turn(h, sid, [4, 4], "t2", rid="t1", n=30)
    for _ in range(4):
        s.step()
        s.check_integrity()
    if how == "close":
        s.close_session(sid)
        h.run()
        assert h.final("t2").finish_reason["type"] == "abort"
    elif how == "timeout":
        h.run()  # no turn in flight from here
        clock[0] += 10
        s.step()
        assert sid not in s.sessions.sessions and other in s.sessions.sessions
    elif how == "flush":
        h.run()
        assert s.flush_cache()
        assert not _held(h)
    elif how == "weights":
        h.run()
        s.forget_drafts()  # what a weight update does first
        assert not _held(h)
    elif how == "abort_all":
        s.handle(AbortReq(abort_all=True))
        h.run()
        assert not _held(h)
    elif how == "retract":
        assert s.pause("retract")
        assert s.resume()
        h.run()
        assert h.tokens("t2") == _expected(p1 + h.tokens("t1") + [4, 4], 30)
    s.check_integrity()
    for sess in list(s.sessions.sessions):
        s.close_session(sess)
    h.assert_idle_and_conserved()


def test_speculation_leaves_no_draft_slot_in_the_session():
    h = make_spec_harness(vocab=11, memory=1, disable_cache=True)
    s = h.scheduler
    sid = _open(h, capacity=500)
    prev = None
    history: list[int] = []
    for i in range(5):
        inp = [t % 11 for t in _prompt(20 + i, 6)]
        h.submit(inp, rid=f"t{i}", max_new_tokens=20 + i, ignore_eos=True, session=SessionParams(sid, rid=prev))
        run_checked(h)
        history = (history + inp) if prev else inp
        assert h.tokens(f"t{i}") == _expected(history, 20 + i, vocab=11, memory=1)
        history += h.tokens(f"t{i}")
        for held in _held(h):
            assert held.kv_allocated_len == held.kv_committed_len
        prev = f"t{i}"
    info = s.get_info()
    assert info["spec_accepted_tokens"] > 0 and info["sessions"]["turns_from_held_kv"] == 4
    s.close_session(sid)
    h.assert_idle_and_conserved()
