"""Overlap scheduling: the forward of batch N runs on a worker thread while the scheduler
builds batch N+1 and then processes N's result (semantics §7).

A decode batch built while the previous decode batch is still running does not know that
batch's sampled tokens yet. Its input ids for those requests are placeholders
`-(row + 1)` naming a row of the previous batch's output; the worker resolves them just
before the forward, when that output exists (the worker runs batches strictly in order).
The sampling snapshot of each such request's output ids gets the resolved token too, so
penalties, seeds and min_new_tokens see the same history as without overlap.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from radixlm.scheduler.batch import BatchResult, ModelRunnerProtocol, WorkerBatch


def placeholder(row: int) -> int:
    return -(row + 1)


class ForwardTimer:
    """How long the model waited between forwards (the scheduler's visible cost)."""

    def __init__(self) -> None:
        self.busy_s = 0.0
        self.idle_s = 0.0
        self._last_end: float | None = None

    def run(self, runner: ModelRunnerProtocol, batch: WorkerBatch) -> BatchResult:
        start = time.perf_counter()
        if self._last_end is not None:
            # gaps longer than a second are "no work", not scheduling overhead
            gap = start - self._last_end
            if gap < 1.0:
                self.idle_s += gap
        result = runner.forward(batch)
        self._last_end = time.perf_counter()
        self.busy_s += self._last_end - start
        return result

    def idle_fraction(self) -> float:
        total = self.busy_s + self.idle_s
        return self.idle_s / total if total else 0.0


@dataclass
class InFlight:
    batch: WorkerBatch
    future: Future

    def result(self) -> BatchResult:
        return self.future.result()


class ForwardWorker:
    """Runs runner.forward on one background thread (torch releases the GIL inside ops)."""

    def __init__(self, runner: ModelRunnerProtocol) -> None:
        self.runner = runner
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="radixlm-forward")
        self._last_batch_id: int | None = None
        self._last_tokens: list[int | None] = []
        self.timer = ForwardTimer()

    def submit(self, batch: WorkerBatch) -> InFlight:
        return InFlight(batch, self._pool.submit(self._run, batch))

    def _run(self, batch: WorkerBatch) -> BatchResult:
        if batch.placeholder_source is not None:
            assert batch.placeholder_source == self._last_batch_id, "placeholders name a batch that did not run last"
            ids = batch.input_ids
            for i, tok in enumerate(ids):
                if tok < 0:
                    resolved = self._last_tokens[-tok - 1]
                    assert resolved is not None, "placeholder for a row that sampled nothing"
                    ids[i] = resolved
                    if batch.output_snapshots is not None:
                        batch.output_snapshots[i].append(resolved)
        result = self.timer.run(self.runner, batch)
        self._last_batch_id = id(batch)
        self._last_tokens = result.next_token_ids
        return result

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
