"""An asyncio reader-writer lock with writer preference, for the weight-update lock.

Requests hold the read side from admission to their answer; a weight update or a memory
release takes the write side, so it waits for running requests and new ones wait behind it
(that wait is a place of the cancel chain: docs/cancel_chain.md).

Three properties the front end relies on:
- cancelling a waiter never leaks a hold: a waiter granted the lock just before its
  cancellation gives it back;
- release is synchronous (a `finally` that answers a caller never suspends);
- readers can be frozen: while the engine is paused no request computes anything, so a
  writer then does not wait for the paused requests (pause → update → continue).
"""
from __future__ import annotations

import asyncio
import collections
import contextlib


class RWLock:
    def __init__(self) -> None:
        self._readers = 0
        self._writer = False
        self._frozen = False
        self._read_waiters: collections.deque[asyncio.Future] = collections.deque()
        self._write_waiters: collections.deque[asyncio.Future] = collections.deque()

    # ------------------------------------------------------------------ state
    @property
    def readers(self) -> int:
        return self._readers

    @property
    def writer_active(self) -> bool:
        return self._writer

    @property
    def writers_waiting(self) -> int:
        return sum(not f.done() for f in self._write_waiters)

    def freeze_readers(self, frozen: bool) -> None:
        """While frozen, a writer is granted even if readers hold the lock."""
        self._frozen = frozen
        self._grant()

    # ------------------------------------------------------------------ read side
    async def acquire_read(self) -> None:
        if not self._writer and not self._pending(self._write_waiters):
            self._readers += 1
            return
        await self._wait(self._read_waiters, self.release_read)

    def release_read(self) -> None:
        assert self._readers > 0, "release_read without a read hold"
        self._readers -= 1
        self._grant()

    # ------------------------------------------------------------------ write side
    async def acquire_write(self) -> None:
        fut = asyncio.get_running_loop().create_future()
        self._write_waiters.append(fut)
        self._grant()
        await self._wait_on(fut, self.release_write)

    def release_write(self) -> None:
        assert self._writer, "release_write without the write hold"
        self._writer = False
        self._grant()

    @contextlib.asynccontextmanager
    async def read(self):
        await self.acquire_read()
        try:
            yield
        finally:
            self.release_read()

    @contextlib.asynccontextmanager
    async def write(self):
        await self.acquire_write()
        try:
            yield
        finally:
            self.release_write()

    # ------------------------------------------------------------------ internals
    async def _wait(self, queue: collections.deque, release) -> None:
        fut = asyncio.get_running_loop().create_future()
        queue.append(fut)
        await self._wait_on(fut, release)

    async def _wait_on(self, fut: asyncio.Future, release) -> None:
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                release()  # granted, then cancelled before the waiter resumed
            else:
                fut.cancel()
                self._grant()  # a cancelled writer may have been holding readers back
            raise

    @staticmethod
    def _pending(queue: collections.deque) -> bool:
        while queue and queue[0].done():
            queue.popleft()  # cancelled waiters
        return bool(queue)

    def _grant(self) -> None:
        if self._writer:
            return
        if self._pending(self._write_waiters):
            if self._readers == 0 or self._frozen:
                self._writer = True
                self._write_waiters.popleft().set_result(None)
            return  # writer preference: readers wait behind a waiting writer
        while self._read_waiters:
            fut = self._read_waiters.popleft()
            if not fut.done():
                self._readers += 1
                fut.set_result(None)
