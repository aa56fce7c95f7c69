"""The scheduler's counters, typed: what get_info reports and /metrics exports."""
from __future__ import annotations

import collections
import dataclasses
from dataclasses import dataclass, field
from typing import Any

__all__ = ["SchedulerStats", "CancelLatency", "CANCEL_LATENCY_BUCKETS"]

# Upper bounds (seconds) of the cancel-latency histogram: abort call -> KV returned.
CANCEL_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, float("inf"))


@dataclass
class SchedulerStats:
    num_retractions: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_cached_tokens: int = 0
    num_steps: int = 0
    num_aborted: int = 0
    num_finished: int = 0
    # where aborts found their request (`in_flight`: inside a launched batch, answered when
    # that batch's result is processed)
    aborts_waiting: int = 0
    aborts_chunked: int = 0
    aborts_running: int = 0
    aborts_in_flight: int = 0
    aborts_grammar: int = 0
    aborts_transfer: int = 0  # disaggregation: while its KV was sent or received
    num_timeouts: int = 0
    num_rejected: int = 0
    # the error boundary (error_boundary.py): requests ended by a failure of their own, and
    # batches run again row by row after a forward failed
    num_request_errors: int = 0
    num_batch_replays: int = 0
    # overlap: queued decode batches taken back before they ran, for an abort (abort_watch.py)
    num_batches_taken_back: int = 0
    # decode batches given back unbuilt: an abort for one of their requests came before launch
    num_batches_unbuilt: int = 0

    def count_abort(self, where: str) -> None:
        name = f"aborts_{where}"
        setattr(self, name, getattr(self, name) + 1)

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


@dataclass
class CancelLatency:
    """Abort call -> KV returned, in seconds: a bounded window for percentiles and a cumulative
    histogram for Prometheus."""

    window: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=4096))
    buckets: tuple[float, ...] = CANCEL_LATENCY_BUCKETS
    counts: list[int] = field(default_factory=lambda: [0] * len(CANCEL_LATENCY_BUCKETS))
    total: float = 0.0
    count: int = 0
    # (rid, abort call, KV returned, launch of the last batch that held it) wall times of the
    # latest cancels (latency benchmarks: was the KV back at the end of the step in progress?)
    recent: collections.deque[tuple[str, float, float, float | None]] = field(
        default_factory=lambda: collections.deque(maxlen=256))

    def add(self, rid: str, sent: float, returned: float, last_launch: float | None = None) -> None:
        latency = max(0.0, returned - sent)
        self.recent.append((rid, sent, returned, last_launch))
        self.window.append(latency)
        self.total += latency
        self.count += 1
        for i, bound in enumerate(self.buckets):
            if latency <= bound:
                self.counts[i] += 1

    def percentiles(self) -> dict[str, Any]:
        lat = sorted(self.window)
        return {"count": len(lat), "p50": lat[len(lat) // 2] if lat else None,
                "p99": lat[min(len(lat) - 1, int(len(lat) * 0.99))] if lat else None}

    def recent_cancels(self) -> list[list[Any]]:
        return [list(c) for c in self.recent]

    def histogram(self) -> dict[str, Any]:
        return {"buckets": list(self.buckets), "counts": list(self.counts), "sum": self.total, "count": self.count}
