"""Tensor-parallel ranks as threads of one process: a TPComm whose collectives meet at a
barrier and reduce in rank order, so the sharded model can be checked against the whole one
without starting processes (the gloo path is tested through the Engine)."""
from __future__ import annotations

import threading
from typing import Callable

import torch


class _Meeting:
    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size, timeout=60)
        self.slots: list[object] = [None] * size


class ThreadComm:
    def __init__(self, meeting: _Meeting, rank: int) -> None:
        self.m = meeting
        self.rank = rank
        self.size = meeting.size

    def _exchange(self, value: object) -> list[object]:
        self.m.slots[self.rank] = value
        self.m.barrier.wait()
        out = list(self.m.slots)
        self.m.barrier.wait()  # nobody overwrites a slot before everyone has read them
        return out

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        parts = self._exchange(x.clone())
        total = parts[0].clone()
        for p in parts[1:]:
            total += p
        return x.copy_(total)

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [p.clone() for p in self._exchange(x.clone())]

    def check_same(self, values: list[int], what: str) -> None:
        if any(v != values for v in self._exchange(list(values))):
            raise RuntimeError(f"tensor-parallel ranks diverged: {what}")


def run_ranks(size: int, fn: Callable[[ThreadComm], object]) -> list[object]:
    """fn(comm) on `size` threads, one per rank; their results in rank order (re-raises)."""
    meeting = _Meeting(size)
    results: list[object] = [None] * size
    errors: list[BaseException] = []

    def body(rank: int) -> None:
        try:
            results[rank] = fn(ThreadComm(meeting, rank))
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            errors.append(e)
            meeting.barrier.abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results
