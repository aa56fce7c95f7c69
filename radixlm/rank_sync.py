"""What the scheduler's decisions may depend on beyond its messages: the clock and the
completion of work on other threads. With tensor parallelism every rank runs the same
scheduler on the same messages, and must take every decision the same way; these two
inputs are where the ranks could differ, so they go through one object.

- `now()`: the time timeouts and queue order are decided by. One rank: time.perf_counter.
  Tensor-parallel ranks: rank 0's clock, broadcast with each step's messages.
- `agree_done(counts)`: how many of some in-order work items (HiCache copies, grammar
  compiles) are done, as the minimum over ranks: a node is unlocked only when its copy is
  done on every rank ("only acks done on every rank"), a grammar request is admitted only
  when every rank has its matcher. One rank: the counts as they are.

Every rank must call agree_done at the same points with lists of the same length (the
lengths come from deterministic state, so they do).
"""
from __future__ import annotations

import time
from typing import Protocol


class RankSync(Protocol):
    def now(self) -> float:
        ...

    def agree_done(self, counts: list[int]) -> list[int]:
        ...


class LocalRank:
    """A single rank: its own clock, its own counts."""

    @staticmethod
    def now() -> float:
        return time.perf_counter()

    @staticmethod
    def agree_done(counts: list[int]) -> list[int]:
        return counts


LOCAL_RANK = LocalRank()
