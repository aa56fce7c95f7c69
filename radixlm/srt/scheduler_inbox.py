"""Rank 0's inbox: the scheduler's input socket, read by the event loop between iterations
and, on a single rank with overlap, looked at while a forward runs (scheduler/abort_watch.py).

What `wait_for` receives stays queued: the loop takes it with `take_all`, before anything
that arrives later, so every message is still handled once and in arrival order.
"""
from __future__ import annotations

import contextlib
import os
from concurrent.futures import Future
from typing import Any

import zmq

from radixlm.ipc import Receiver


class SchedulerInbox:
    def __init__(self, receiver: Receiver) -> None:
        self.receiver = receiver
        self._queued: list[object] = []
        # a forward's end wakes the poll through this pipe (a future cannot be polled)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poller = zmq.Poller()
        self._poller.register(receiver.sock, zmq.POLLIN)
        self._poller.register(self._wake_r, zmq.POLLIN)

    @property
    def sock(self) -> zmq.Socket:
        return self.receiver.sock

    def take_all(self) -> list[object]:
        """Everything received so far, in arrival order, without blocking."""
        out, self._queued = self._queued, []
        return out + self.receiver.recv_all()

    def has_queued(self) -> bool:
        return bool(self._queued)

    def wait(self, timeout_ms: int) -> bool:
        return self.has_queued() or self.receiver.wait(timeout_ms)

    def peek(self) -> list[object]:
        """What arrived since the last look, without blocking; it stays queued for take_all."""
        new = self.receiver.recv_all()
        self._queued += new
        return new

    def wait_for(self, future: Future[Any]) -> list[object]:
        future.add_done_callback(self._wake)  # runs at once if it is done already
        self._poller.poll()
        with contextlib.suppress(BlockingIOError):
            os.read(self._wake_r, 4096)
        return self.peek()

    def _wake(self, _future: Future[Any]) -> None:
        with contextlib.suppress(BlockingIOError):  # the pipe is full: a wake-up is pending anyway
            os.write(self._wake_w, b"x")

    def close(self) -> None:
        os.close(self._wake_r)
        os.close(self._wake_w)
