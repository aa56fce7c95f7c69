"""Overlap: aborts read while the running batch computes (semantics §3, §7).

With overlap the scheduler launches batch N+1 before it waits for batch N, and it reads its
messages only between iterations. An abort that arrives while N computes would therefore be
read after N+1 has started with the aborted request in it, and its KV would come back only
when N+1 ends: one to two steps after the abort. Instead, while it waits for N, the scheduler
looks at what arrives (the messages stay queued for the loop, in order); when an abort names a
request of N+1 and the forward thread has not started N+1 yet, N+1 is taken back (its future
cancelled, its launch and its decode slots undone). The loop then applies the abort in order,
with nothing in flight, and the KV is back when N ends: within one step.

Without overlap the forward runs on the scheduler's own thread, so an abort that arrives while
it runs is read after it, with nothing else in flight: the KV is back at the end of that step.
What is left is the short time between the loop reading its messages and the launch (the next
batch is built then): an abort arriving there would wait for a whole step more. So before a
decode batch is launched with nothing in flight, the inbox is looked at once more (`peek`,
non-blocking); when an abort names one of the batch's requests, the batch is given back unbuilt
(`Scheduler._unbuild_decode`) and the loop applies the abort before the step is built again.

Only decode batches are taken back (a prefill's admission is not undone), and only on a
single rank: tensor-parallel ranks must launch the same batches, and the moment a message
arrives is not something they agree on.
"""
from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol

from radixlm.messages import AbortReq
from radixlm.scheduler.abort import abort_matcher

if TYPE_CHECKING:
    from radixlm.core import Req
    from radixlm.scheduler.batch import WorkerBatch
    from radixlm.scheduler.overlap import InFlight


class Inbox(Protocol):
    def wait_for(self, future: Future[Any]) -> list[object]:
        """Block until `future` is done or messages arrive; return the messages that arrived
        (they stay queued for the event loop, which handles them in arrival order)."""
        ...

    def peek(self) -> list[object]:
        """The messages that arrived since the last look, without blocking (queued as above)."""
        ...


def names_any(msgs: Iterable[object], reqs: list[Req]) -> bool:
    """Whether one of `msgs` is an abort that names one of `reqs` (not already ending)."""
    for msg in msgs:
        if isinstance(msg, AbortReq):
            named = abort_matcher(msg)
            if any(r.to_finish is None and not r.finished and named(r.rid) for r in reqs):
                return True
    return False


def can_take_back(queued: InFlight) -> bool:
    return can_unbuild(queued.batch)


def can_unbuild(batch: WorkerBatch) -> bool:
    return batch.is_decode and batch.drafts is None


def aborted_before_launch(inbox: Inbox, batch: WorkerBatch) -> bool:
    """Nothing in flight, `batch` about to launch: whether an abort naming one of its requests
    has arrived since the loop read its messages (the caller then gives the batch back)."""
    return can_unbuild(batch) and names_any(inbox.peek(), batch.reqs)


def watch(inbox: Inbox, running: InFlight, queued: InFlight) -> bool:
    """Wait until `running` is done with the model, looking at each message that arrives;
    True when an abort named a request of `queued` and `queued` was cancelled before the
    forward thread started it (the caller undoes its launch)."""
    while not running.future.done():
        if names_any(inbox.wait_for(running.future), queued.batch.reqs):
            # cancel() fails once the forward thread has taken the batch: it then runs, and the
            # abort is applied at its end as before
            return queued.future.cancel()
    return False
