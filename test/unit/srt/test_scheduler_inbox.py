"""The scheduler's inbox: a forward's end or a message wakes wait_for, and what it received
is still handed to the event loop once, before later messages, in arrival order."""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import zmq

from radixlm.ipc import Receiver, Sender
from radixlm.messages import AbortReq
from radixlm.srt.scheduler_inbox import SchedulerInbox


HANG_MS = 60_000  # a wait that should end at once is called a hang after this (a busy machine is slow)


def _pair(tmp_path):
    ctx = zmq.Context()
    addr = f"ipc://{tmp_path}/inbox"
    inbox = SchedulerInbox(Receiver(ctx, addr))
    return ctx, inbox, Sender(ctx, addr)


def _recv(inbox: SchedulerInbox, future: Future, timeout: float = HANG_MS / 1000) -> list:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = inbox.wait_for(future)
        if got or future.done():
            return got
    raise AssertionError("nothing woke the inbox")


def test_a_message_wakes_the_wait_and_stays_queued_in_order(tmp_path):
    ctx, inbox, out = _pair(tmp_path)
    try:
        pending: Future = Future()
        out.send(AbortReq(rid="first"))
        threading.Timer(0.05, out.send, args=(AbortReq(rid="second"),)).start()
        seen = []
        while len(seen) < 2:
            seen += _recv(inbox, pending)
        assert [m.rid for m in seen] == ["first", "second"] and not pending.done()
        out.send(AbortReq(rid="third"))
        assert inbox.receiver.wait(HANG_MS)  # "third" has arrived (not read yet)
        assert inbox.has_queued() and inbox.wait(0)
        assert [m.rid for m in inbox.take_all()] == ["first", "second", "third"]
        assert inbox.take_all() == [] and not inbox.has_queued()
    finally:
        inbox.close()
        ctx.destroy(linger=0)


def test_the_forward_ending_wakes_the_wait(tmp_path):
    ctx, inbox, _ = _pair(tmp_path)
    try:
        done: Future = Future()
        threading.Timer(0.05, done.set_result, args=(None,)).start()
        t0 = time.monotonic()
        assert _recv(inbox, done) == [] and done.done()
        assert time.monotonic() - t0 < HANG_MS / 1000  # woken by the future, not a hang
        finished: Future = Future()
        finished.set_result(None)
        assert inbox.wait_for(finished) == []  # already done: returns at once
        # a wake-up left over from an earlier future does not end a later wait early for good
        later: Future = Future()
        threading.Timer(0.05, later.set_result, args=(None,)).start()
        assert _recv(inbox, later) == [] and later.done()
    finally:
        inbox.close()
        ctx.destroy(linger=0)


def test_peek_never_blocks_and_keeps_what_it_saw_queued_in_order(tmp_path):
    ctx, inbox, out = _pair(tmp_path)
    try:
        t0 = time.monotonic()
        assert inbox.peek() == [] and time.monotonic() - t0 < 5.0  # returns, does not wait for a message
        out.send(AbortReq(rid="first"))
        seen: list = []
        end = time.monotonic() + HANG_MS / 1000
        while not seen and time.monotonic() < end:
            seen = inbox.peek()
            time.sleep(0.005)
        assert [m.rid for m in seen] == ["first"]
        out.send(AbortReq(rid="second"))
        assert inbox.receiver.wait(HANG_MS)
        assert [m.rid for m in inbox.take_all()] == ["first", "second"]
        assert inbox.peek() == [] and inbox.take_all() == []
    finally:
        inbox.close()
        ctx.destroy(linger=0)
