"""Priority scheduling (`--enable-priority-scheduling`, semantics §14): a request's rank, who is
preempted for it, and who a full queue turns away.

A request's `priority` field in the scheduler is its *rank*: larger runs first, whichever way
the user's values go (`--schedule-low-priority-values-first` negates them). Without the flag
every rank is 0, so every ordering in the scheduler is what it was before (a priority sent
anyway is accepted and ignored, as SGLang does).

Preemption is a retraction: the scheduler retracts the victims chosen here through its one
retraction path (`Scheduler.retract_victims`), so their KV goes to the tree, the new-token
ratio is updated and nothing here releases KV.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from radixlm.core import Req
from radixlm.scheduler.config import PriorityConfig
from radixlm.scheduler.port import RequestOps, StepHooks
from radixlm.scheduler.prefill import AddStatus, PrefillAdder
from radixlm.scheduler.requests import Place
from radixlm.scheduler.retract import retraction_order

__all__ = ["PriorityScheduling"]


@dataclass
class PriorityScheduling(StepHooks):
    config: PriorityConfig
    retraction_policy: str = "length"
    # per user-facing priority value
    preempted: Counter[int] = field(default_factory=Counter)
    rejected: Counter[int] = field(default_factory=Counter)  # turned away or evicted by a full queue
    _ops: RequestOps | None = None

    def bind(self, ops: RequestOps) -> None:
        self._ops = ops

    # ------------------------------------------------------------------ values
    def rank(self, value: int | None) -> int:
        v = self.config.default_priority if value is None else value
        return -v if self.config.low_values_first else v

    def value(self, rank: int) -> int:
        """The user's priority value of a rank (for metrics)."""
        return -rank if self.config.low_values_first else rank

    # ------------------------------------------------------------------ choices
    def order(self, ordered: list[Req]) -> list[Req]:
        """A policy's order of the waiting queue, made priority-first (stable: the policy's
        order, e.g. arrival or longest prefix, holds within one priority)."""
        return sorted(ordered, key=lambda r: -r.priority)

    def _can_preempt(self, newcomer: Req, victim: Req) -> bool:
        return newcomer.priority - victim.priority >= max(self.config.preemption_threshold, 1)

    def may_preempt(self, waiting: list[Req], running: list[Req]) -> bool:
        """Whether some waiting request outranks some running one by the threshold (cheap:
        the scheduler settles the launched batch before admission only then)."""
        if not waiting or not running:
            return False
        top = max(waiting, key=lambda r: r.priority)
        low = min(running, key=lambda r: r.priority)
        return self._can_preempt(top, low)

    def victims(self, newcomer: Req, running: list[Req]) -> list[Req]:
        """The running requests `newcomer` may preempt, first victim first: lowest priority
        first, then the retraction policy's order among equals (retraction_order's)."""
        eligible = [r for r in running if self._can_preempt(newcomer, r)]
        return list(reversed(retraction_order(eligible, self.retraction_policy)))

    def admit_preempting(self, adder: PrefillAdder, req: Req, status: AddStatus, running: list[Req],
                         admit: Callable[[Req], AddStatus],
                         retract: Callable[[Req], None]) -> tuple[AddStatus, list[Req]]:
        """`req` was just turned away with `status`. When that was for KV or running slots,
        retract the running requests it outranks by the threshold, one at a time (each through
        `retract`, the scheduler's one retraction), trying `admit` again after each, until it
        is admitted or none is left. Returns the last status and the requests retracted."""
        victims = self.victims(req, running)
        taken: list[Req] = []
        while victims and not adder.admitted(req) and adder.out_of_room(status):
            victim = victims.pop(0)
            adder.drop_running(victim)
            retract(victim)
            taken.append(victim)
            status = admit(req)
        self.count_preempted(taken)
        return status, taken

    def queue_victim(self, newcomer: Req, queued: list[Req]) -> Req | None:
        """The queue is full: the queued request to turn away for `newcomer` (the lowest
        priority, the latest among equals) when `newcomer` outranks it; None: turn `newcomer`
        away."""
        if not queued:
            return None
        lowest = min(queued, key=lambda r: (r.priority, -r.created_time))
        return lowest if lowest.priority < newcomer.priority else None

    # ------------------------------------------------------------------ counters
    def count_preempted(self, reqs: list[Req]) -> None:
        self.preempted.update(self.value(r.priority) for r in reqs)

    def count_rejected(self, req: Req) -> None:
        self.rejected[self.value(req.priority)] += 1

    def info(self) -> dict[str, Any]:
        queued: Counter[int] = Counter()
        running: Counter[int] = Counter()
        if self._ops is not None:
            queued.update(self.value(r.priority) for r in self._ops.find(lambda r: True, Place.WAITING))
            running.update(self.value(r.priority)
                           for r in self._ops.find(lambda r: True, Place.RUNNING, Place.CHUNKED))
        return {"priority": {"queued": _by_value(queued), "running": _by_value(running),
                             "preempted_total": _by_value(self.preempted),
                             "rejected_total": _by_value(self.rejected)}}


def _by_value(counts: Counter[int]) -> dict[str, int]:
    """JSON-ready: keys are strings, in priority order."""
    return {str(k): v for k, v in sorted(counts.items())}
