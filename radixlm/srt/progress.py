"""A progress bar for many requests at once, measured in generated tokens.

Counting finished requests gives a false rate under continuous batching: every request starts
at once and most finish together near the end, so the rate measured from the first one to
finish (one request after minutes) predicted hours for a batch that took two minutes. Tokens
come out steadily, so the bar counts them: the rate is the engine's generation rate, and the
ETA is the tokens still expected over that rate. A request's expected length is its
max_new_tokens until requests finish, then the mean length of the finished ones (capped by its
own max_new_tokens); with neither known the bar shows no ETA rather than a made-up one.
"""
from __future__ import annotations

import asyncio
import sys
import time
from typing import Callable, TextIO

# How often the bar reads the token counter.
REFRESH_S = 0.5
# With nothing new, the bar is redrawn this often only.
IDLE_REDRAW_S = 5.0


class TokenProgress:
    def __init__(self, max_new_tokens: list[int | None], tokens_generated: Callable[[], int], desc: str = "generate",
                 file: TextIO | None = None, disable: bool = False) -> None:
        from tqdm import tqdm

        self._limits = list(max_new_tokens)  # per request still running (None: unknown)
        self._counter = tokens_generated
        self._start_count = tokens_generated()
        self._finished_tokens = 0
        self._finished = 0
        self.total_requests = len(self._limits)
        self.bar = tqdm(total=None, desc=desc, unit="tok", file=file or sys.stderr, disable=disable,
                        dynamic_ncols=True, mininterval=REFRESH_S)
        self._task: asyncio.Task | None = None
        self._shown: tuple | None = None
        self.refresh()

    @property
    def generated(self) -> int:
        return max(0, self._counter() - self._start_count)

    def expected_remaining(self) -> int | None:
        """Tokens the unfinished requests are still expected to generate (None: unknown)."""
        running = self.generated - self._finished_tokens
        mean = self._finished_tokens / self._finished if self._finished else None
        expected = 0.0
        for limit in self._limits:
            if mean is not None:
                expected += mean if limit is None else min(limit, mean)
            elif limit is not None:
                expected += limit
            else:
                return None
        return max(0, round(expected - max(0, running)))

    def add(self, max_new_tokens: int | None) -> int:
        """One more request (a batch read as it runs); returns its index for finish()."""
        self._limits.append(max_new_tokens)
        self.total_requests += 1
        return len(self._limits) - 1

    def finish(self, index: int, completion_tokens: int) -> None:
        """Request `index` (its position in max_new_tokens) ended with this many tokens."""
        self._limits[index] = 0
        self._finished += 1
        self._finished_tokens += completion_tokens
        self.refresh()

    def refresh(self) -> None:
        done = self.generated
        remaining = self.expected_remaining()
        total = None if remaining is None else done + remaining
        # the clock every IDLE_REDRAW_S: a stalled bar still shows time passing
        state = (done, total, self._finished, self.total_requests, int(time.monotonic() // IDLE_REDRAW_S))
        if state == self._shown:
            return  # nothing new: no redraw (a log file would get a line per tick)
        self._shown = state
        self.bar.total = total
        self.bar.set_postfix_str(f"{self._finished}/{self.total_requests} requests", refresh=False)
        if done > self.bar.n:
            self.bar.update(done - self.bar.n)  # tqdm's smoothed rate follows its updates
        else:
            self.bar.refresh()

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(REFRESH_S)
            self.refresh()

    def start(self) -> "TokenProgress":
        """Refresh on the running event loop until close()."""
        self._task = asyncio.get_running_loop().create_task(self._tick())
        return self

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self.refresh()
        self.bar.close()
