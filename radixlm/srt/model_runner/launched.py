"""A forward that has been launched but whose result the host may not have read yet.

On a GPU the model runner launches every batch on its own CUDA stream (`ForwardStream`):
the kernels of the forward and sampling are queued, the sampled tokens stay on the device
(where the next batch's placeholder input ids are resolved from them), and their host
copies are started with `non_blocking` into pinned memory, followed by a *copy-done* event.
`LaunchedBatch.result()` waits for that event only; so the forward thread can queue batch
N+1 while batch N still computes, and the scheduler thread blocks only when it processes
N's result (semantics §7).

On the CPU every op is synchronous: there is no stream and no event, the host copies are
the tensors themselves, and `result()` only converts them. The same code runs on both, so
the CPU test suite covers everything but the stream and event calls.
"""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from radixlm.scheduler.batch import BatchResult, WorkerBatch
from radixlm.srt.model_runner.sampling_batch import SampleTensors


class ForwardStream:
    """Where forwards run and how their progress is observed.

    `scope()` makes the forward stream current for the calling thread (CUDA streams are
    per thread) after ordering it behind the default stream, so weight updates, pool
    (re)allocation and cache flushes done there are visible to the next forward.
    `mark()` returns a timestamp of "the stream got here": a recorded timing event on CUDA
    (read later by `seconds()`, relative to an origin event), perf_counter on the CPU.
    """

    def __init__(self, device: str) -> None:
        self.cuda = torch.device(device).type == "cuda"
        if self.cuda:
            self.stream = torch.cuda.Stream(device)
            self._origin = torch.cuda.Event(enable_timing=True)
            self._origin.record(torch.cuda.current_stream(device))
            self._device = device
        else:
            self.stream = None

    @contextmanager
    def scope(self) -> Iterator[None]:
        if not self.cuda:
            yield
            return
        self.stream.wait_stream(torch.cuda.default_stream(self._device))
        with torch.cuda.stream(self.stream):
            yield

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(self.stream)
        return ev

    def seconds(self, mark: Any) -> float:
        """The time of a mark on a clock common to this stream's marks; on CUDA only after
        the event has completed."""
        if not self.cuda:
            return mark
        return self._origin.elapsed_time(mark) / 1000.0

    def copy_done_event(self) -> Any:
        """An event after the host copies queued so far (None on the CPU: they are done)."""
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(self.stream)
        return ev

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """A host copy of t, asynchronous on CUDA (pinned memory; valid after the copy-done
        event); t itself on the CPU."""
        if t.device.type == "cpu":
            return t
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        return host


@dataclass
class LaunchedBatch:
    """The runner's half of overlap scheduling for one batch (see the module docstring).

    `tokens` (int64 [num requests] on the device; -1 where nothing was sampled) is what the
    next batch's placeholders are resolved from. Everything the host reads is in
    `sampled` (host copies) or was computed on the host while launching (`ready`).
    """

    batch: WorkerBatch
    tokens: torch.Tensor
    sample_rows: list[int]
    sampled: SampleTensors | None  # host copies of the sampler's result for sample_rows
    copy_done: Any  # a CUDA event, or None when the copies are done
    start: Any  # ForwardStream marks around the forward and sampling
    end: Any
    clock: ForwardStream
    # Parts the launch already had to compute on the host: input logprobs, grammar status.
    ready: dict[str, Any] = field(default_factory=dict)
    _result: BatchResult | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def result(self) -> BatchResult:
        """Wait for the copy-done event and build the host result (once; thread-safe: the
        forward thread may need the tokens of the previous batch too)."""
        with self._lock:
            if self._result is None:
                if self.copy_done is not None:
                    self.copy_done.synchronize()
                self._result = self._build()
            return self._result

    def span(self) -> tuple[float, float]:
        """When the forward started and ended, in seconds on the runner's clock (CUDA: GPU
        time, so the gap to the previous batch is time the GPU waited). Valid after result()."""
        return self.clock.seconds(self.start), self.clock.seconds(self.end)

    def _build(self) -> BatchResult:
        n = len(self.batch.reqs)
        next_ids: list[int | None] = [None] * n
        logprobs: list[float | None] = [None] * n
        tops: list[list[tuple[float, int]] | None] = [None] * n
        if self.sampled is not None:
            out = self.sampled.to_output()
            for j, i in enumerate(self.sample_rows):
                next_ids[i] = out.next_token_ids[j]
                logprobs[i] = out.logprobs[j]
                tops[i] = out.top_logprobs[j]
        return BatchResult(next_ids, logprobs, tops,
                           self.ready.get("input_logprobs", [None] * n),
                           self.ready.get("input_top_logprobs", [None] * n),
                           self.ready.get("grammar_status"), self.ready.get("verified"))
