"""The front end's request table and the weight lock, without processes: families by
identity, prefix only when asked, tombstones (TTL, bound, not after an answer), one-step
duplicate checks, a call's end never touching another's state; the lock's cancellation
safety, writer preference and frozen readers."""
from __future__ import annotations

import asyncio

import pytest

from radixlm.messages import TokenizedGenerateReq
from radixlm.sampling_params import SamplingParams
from radixlm.srt import request_table as rt
from radixlm.srt.request_table import RequestTable
from radixlm.srt.rwlock import RWLock


def _reqs(rid: str, n: int) -> tuple[list, list]:
    names = [rid] if n == 1 else [f"{rid}_{i}" for i in range(n)]
    reqs = [TokenizedGenerateReq(rid=r, input_ids=[1, 2, 3], sampling_params=SamplingParams()) for r in names]
    return reqs, [None if n == 1 else rid] * n


def _call(table: RequestTable, rid: str, n: int = 1, sent: bool = True):
    call = table.arrive([rid], [n], False)
    table.register(call, *_reqs(rid, n))
    if sent:
        for i, st in enumerate(call.states):
            table.send(st, f"{st.rid}#{i}")
    return call


def _hit(table: RequestTable, rid: str = "", abort_all: bool = False, prefix: bool = False) -> set[str]:
    early, reqs = table.find(rid, abort_all, prefix)
    return {st.rid for st in reqs} | {name for _, name in early}


def test_a_family_is_known_by_identity_never_by_the_shape_of_a_rid():
    t = RequestTable()
    for rid, n in [("job", 1), ("job_1", 1), ("fam", 3), ("fam_7", 1), ("famous", 1)]:
        _call(t, rid, n)
    assert _hit(t, "job") == {"job"}
    assert _hit(t, "fam") == {"fam_0", "fam_1", "fam_2"}
    assert _hit(t, "fam_1") == {"fam_1"}  # one child by its own name
    assert _hit(t, "fam", prefix=True) == {"fam_0", "fam_1", "fam_2", "fam_7", "famous"}
    assert _hit(t, abort_all=True) == {"job", "job_1", "fam_0", "fam_1", "fam_2", "fam_7", "famous"}
    assert t.families == {"fam": ["fam_0", "fam_1", "fam_2"]}


def test_rids_are_claimed_at_arrival_and_children_at_registration():
    t = RequestTable()
    t.arrive(["a"], [2], False)  # tokenizing
    with pytest.raises(ValueError, match="duplicate request id 'a'"):
        t.arrive(["a"], [1], False)
    _call(t, "b_1")
    call = t.arrive(["b"], [2], False)
    with pytest.raises(ValueError, match="duplicate request id 'b_1'"):  # b's child would be b_1
        t.register(call, *_reqs("b", 2))
    with pytest.raises(ValueError, match="distinct"):
        t.arrive(["c", "c"], [1, 1], False)


def test_a_calls_end_frees_only_its_own_names():
    t = RequestTable()
    first = _call(t, "dup")
    with pytest.raises(ValueError):
        t.arrive(["dup"], [1], False)
    assert t.states["dup"].call is first  # the refused one took nothing
    t.end(first)
    assert t.names == {} and t.states == {} and t.by_sched == {}
    again = _call(t, "dup")  # reusable at once
    assert t.states["dup"].call is again


def test_tombstones_apply_on_arrival_expire_and_are_bounded(monkeypatch):
    t = RequestTable()
    assert t.tombstone("later")
    call = t.arrive(["later"], [1], False)
    assert call.aborted == {"later": rt.USER_ABORT}  # applied before anything is sent
    states = t.register(call, *_reqs("later", 1))
    assert states[0].done and states[0].pending[-1].out.finish_reason == rt.USER_ABORT
    t.end(call)
    assert not t.tombstone("later")  # just answered: a late abort is a no-op, not a tombstone
    # a child named before its family exists
    assert t.tombstone("kids_1")
    kids = t.arrive(["kids"], [3], False)
    assert [st.done for st in t.register(kids, *_reqs("kids", 3))] == [False, True, False]
    # bounded, and expired after the TTL
    monkeypatch.setattr(rt, "MAX_TOMBSTONES", 3)
    for i in range(5):
        t.tombstone(f"t{i}")
    assert t.places()["tombstones"] == 3
    now = [1000.0]
    monkeypatch.setattr(rt.time, "monotonic", lambda: now[0])
    t2 = RequestTable()
    t2.tombstone("x")
    now[0] += rt.TOMBSTONE_TTL_S + 1
    assert t2.arrive(["x"], [1], False).aborted == {}


def test_answered_requests_drain_and_later_outputs_are_dropped():
    t = RequestTable()
    call = _call(t, "r")
    st = call.states[0]
    st.done = True
    t.detach(st)
    assert t.by_sched == {} and list(t.draining) == ["r#0"]
    from radixlm.messages import ReqOutput
    t.drop(ReqOutput(rid="r#0", new_token_ids=[5], finish_reason=None, prompt_tokens=3, completion_tokens=1,
                     cached_tokens=0))
    assert list(t.draining) == ["r#0"]
    t.drop(ReqOutput(rid="r#0", new_token_ids=[], finish_reason={"type": "abort"}, prompt_tokens=3,
                     completion_tokens=1, cached_tokens=0))
    assert t.places()["draining"] == 0


def test_places_count_requests_where_they_are():
    t = RequestTable()
    t.arrive(["tok"], [2], False)  # tokenizing, a family of two
    held = _call(t, "held", sent=False)
    held.place = rt.PAUSED
    lock = _call(t, "lock", 2, sent=False)
    lock.place = rt.WEIGHT_LOCK
    _call(t, "run")
    p = t.places()
    assert (p["tokenizing"], p["paused"], p["weight_lock"], p["sent"]) == (2, 1, 2, 1)


# ---------------------------------------------------------------------------- the lock
def test_rwlock_writer_waits_for_readers_and_new_readers_wait_for_it():
    async def go():
        lock = RWLock()
        await lock.acquire_read()
        writer = asyncio.ensure_future(lock.acquire_write())
        await asyncio.sleep(0)
        assert not writer.done() and lock.writers_waiting == 1
        reader = asyncio.ensure_future(lock.acquire_read())
        await asyncio.sleep(0)
        assert not reader.done()  # writer preference
        lock.release_read()
        await writer
        assert lock.writer_active and not reader.done()
        lock.release_write()
        await reader
        assert lock.readers == 1
    asyncio.run(go())


def test_rwlock_cancelling_a_waiter_never_leaks_a_hold():
    async def go():
        lock = RWLock()
        await lock.acquire_write()
        reader = asyncio.ensure_future(lock.acquire_read())
        await asyncio.sleep(0)
        lock.release_write()  # grants the reader...
        reader.cancel()  # ...which is cancelled before it resumes
        with pytest.raises(asyncio.CancelledError):
            await reader
        assert lock.readers == 0  # given back
        await lock.acquire_read()
        writer = asyncio.ensure_future(lock.acquire_write())
        await asyncio.sleep(0)
        writer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await writer
        assert lock.writers_waiting == 0
        await asyncio.wait_for(lock.acquire_read(), 1)  # a cancelled writer holds no reader back
        assert lock.readers == 2
    asyncio.run(go())


def test_rwlock_frozen_readers_do_not_hold_a_writer_back():
    async def go():
        lock = RWLock()
        await lock.acquire_read()
        writer = asyncio.ensure_future(lock.acquire_write())
        await asyncio.sleep(0)
        assert not writer.done()
        lock.freeze_readers(True)  # paused: the reader computes nothing
        await asyncio.wait_for(writer, 1)
        lock.release_write()
        lock.freeze_readers(False)
        lock.release_read()
        assert lock.readers == 0 and not lock.writer_active
    asyncio.run(go())
