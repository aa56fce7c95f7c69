"""Overlap scheduling: batch N+1 is launched by a forward thread while the scheduler
processes the result of batch N (semantics §7).

A decode batch built while the previous decode batch is still running does not know that
batch's sampled tokens yet. Its input ids for those requests are placeholders
`-(row + 1)` naming a row of the previous batch's output, and the output snapshot the
sampler reads for such a request ends with the same placeholder. The runner resolves the
input ids where the forward runs, from the previous batch's device-side token tensor
(`resolve_placeholders`; on a GPU without waiting for the host), since the forward thread
launches batches strictly in order. Snapshot values are read only by penalties: a runner
with penalty rows waits for the previous result and fills them in (`fill_snapshots`);
seeds and min_new_tokens only need the snapshot's length, which is right either way.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from radixlm.scheduler.batch import BatchResult, LaunchedForward, ModelRunnerProtocol, WorkerBatch


def placeholder(row: int) -> int:
    return -(row + 1)


def resolve_placeholders(ids: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """ids with each placeholder replaced by the token it names in `tokens` (the previous
    batch's per-row tokens, on the same device); device ops only, nothing waits."""
    rows = (-ids - 1).clamp_(min=0)
    return torch.where(ids < 0, tokens.index_select(0, rows), ids)


def fill_snapshots(batch: WorkerBatch, tokens: list[int | None]) -> None:
    """Replace each output snapshot's trailing placeholder with the token it names."""
    for snap in batch.output_snapshots or []:
        if snap and snap[-1] < 0:
            tok = tokens[-snap[-1] - 1]
            assert tok is not None, "placeholder for a row that sampled nothing"
            snap[-1] = tok


def snapshot_values_needed(batch: WorkerBatch) -> bool:
    """True when a row whose snapshot ends with a placeholder has penalties (which count
    the tokens' values)."""
    if batch.output_snapshots is None:
        return False
    return any(snap and snap[-1] < 0 and req.sampling_params.has_penalty
               for req, snap in zip(batch.reqs, batch.output_snapshots, strict=True))


class ForwardTimer:
    """How long the model waited between forwards (the scheduler's visible cost), from the
    launched batches' spans: on a GPU their stream's timing events, on the CPU wall time."""

    def __init__(self) -> None:
        self.busy_s = 0.0
        self.idle_s = 0.0
        self._last_end: float | None = None

    def add(self, launched: LaunchedForward) -> None:
        start, end = launched.span()
        if self._last_end is not None:
            # gaps longer than a second are "no work", not scheduling overhead
            gap = start - self._last_end
            if 0.0 <= gap < 1.0:
                self.idle_s += gap
        self._last_end = end
        self.busy_s += end - start

    def idle_fraction(self) -> float:
        total = self.busy_s + self.idle_s
        return self.idle_s / total if total else 0.0


@dataclass
class InFlight:
    batch: WorkerBatch
    future: Future[LaunchedForward]
    timer: ForwardTimer
    _result: BatchResult | None = None
    launched_at: float = 0.0  # wall time the scheduler handed it to the worker

    def result(self) -> BatchResult:
        """Wait until the batch is launched and its result copied to the host."""
        if self._result is None:
            launched = self.future.result()
            self._result = launched.result()
            self.timer.add(launched)
        return self._result


class ForwardWorker:
    """Launches batches in order: on one background thread with overlap (torch releases the
    GIL inside ops; on a GPU the launch itself returns before the kernels finish), else on the
    calling thread, to its result. `before_launch` runs right before each launch, on the
    launching thread (HiCache: the batch's loads from the host tier have landed)."""

    def __init__(self, runner: ModelRunnerProtocol, before_launch: Callable[[], None], threaded: bool) -> None:
        self.runner = runner
        self.before_launch = before_launch
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="radixlm-forward") if threaded else None
        self._last: LaunchedForward | None = None
        self.timer = ForwardTimer()

    def submit(self, batch: WorkerBatch) -> InFlight:
        if self._pool is not None:
            return InFlight(batch, self._pool.submit(self._launch, batch), self.timer)
        done: Future[LaunchedForward] = Future()
        try:
            done.set_result(self._launch(batch))
        except Exception as e:  # noqa: BLE001 - raised again by result(), where the error boundary replays it
            done.set_exception(e)
        launched = InFlight(batch, done, self.timer)
        with contextlib.suppress(Exception):
            launched.result()  # overlap off: the forward runs to its result now (a failure: at result())
        return launched

    def _launch(self, batch: WorkerBatch) -> LaunchedForward:
        self.before_launch()
        # the runner checks that placeholders name this batch (it must read its tokens)
        launched = self.runner.launch(batch, self._last if batch.placeholder_source is not None else None)
        self._last = launched
        return launched

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
