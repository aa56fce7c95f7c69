"""Python's garbage collector in radixlm's own processes: freeze what start-up built, and
measure every collection.

A process that has loaded a model holds hundreds of thousands of long-lived objects (torch
modules, the tokenizer, the scheduler's tables). A full (generation 2) collection walks all of
them, and in the scheduler it runs in the middle of a step: while it runs nothing is
scheduled and no KV is released. `freeze_startup_heap()` collects once and moves everything
alive to the permanent generation (`gc.freeze()`), so later collections walk only what was
allocated while serving. It is called in the processes radixlm owns (the scheduler and
detokenizer children, the `radixlm serve` front end), never in a user's process that embeds
the Engine: freezing is a whole-process decision.

`GCWatch` hooks `gc.callbacks` and counts collections and their pauses per generation; the
scheduler reports them in get_server_info ("gc"), and a pause longer than
`--gc-warning-threshold-secs` (when set) is logged as a warning.
"""
from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

__all__ = ["GCWatch", "freeze_startup_heap"]


def freeze_startup_heap() -> int:
    """Collect, then freeze every surviving object; returns how many are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


@dataclass
class GCWatch:
    """Collections and their pauses, per generation, in this process."""

    warn_threshold_s: float = 0.0  # 0: never warn
    counts: list[int] = field(default_factory=lambda: [0, 0, 0])
    total_s: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    max_s: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    _start: float = 0.0

    def install(self) -> GCWatch:
        gc.callbacks.append(self._on_gc)
        return self

    def uninstall(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        gen = min(int(info.get("generation", 2)), 2)
        pause = time.perf_counter() - self._start
        self.counts[gen] += 1
        self.total_s[gen] += pause
        self.max_s[gen] = max(self.max_s[gen], pause)
        if self.warn_threshold_s and pause > self.warn_threshold_s:
            logger.warning("a generation-%d garbage collection took %.3f s (collected %d objects)",
                           gen, pause, info.get("collected", 0))

    def stats(self) -> dict:
        return {"frozen_objects": gc.get_freeze_count(), "collections": list(self.counts),
                "pause_total_s": [round(t, 4) for t in self.total_s],
                "pause_max_s": [round(t, 4) for t in self.max_s]}
