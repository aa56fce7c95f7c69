"""The port plug-ins drive the scheduler through: `RequestOps` (what a plug-in may do to a
request) and `StepHooks` (where the scheduler calls a plug-in back).

Speculation, the error boundary and both sides of prefill/decode disaggregation see the
scheduler only as a `RequestOps`; the control handlers see it as a `ControlOps` (the port plus
the control surface). None of them imports the `Scheduler`, which implements both; a test can
drive any of them through a fake port.

Every request still ends one way: `stop` (which knows about launched batches) or, for a
request in no place, `finish`. Tokens a forward produced are accepted one way: `advance`,
then `settle.settle_prefilled` / `settle.settle_decoded` (scheduler/settle.py).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from radixlm.core import FinishReason, Req
from radixlm.scheduler.requests import Place, RequestTable

if TYPE_CHECKING:
    from radixlm.messages import AbortReq, TokenizedGenerateReq
    from radixlm.scheduler.batch import ModelRunnerProtocol
    from radixlm.scheduler.cache_manager import CacheManager
    from radixlm.scheduler.grammar_queue import GrammarQueue
    from radixlm.scheduler.overlap import ForwardTimer
    from radixlm.scheduler.retract import NewTokenRatioTracker
    from radixlm.scheduler.sessions import SessionTable
    from radixlm.scheduler.stats import CancelLatency, SchedulerStats

__all__ = ["RequestOps", "StepHooks", "TransferHooks", "InfoHook", "ControlOps"]


class RequestOps(Protocol):
    @property
    def cache(self) -> CacheManager:
        """The one owner of every request's KV (slots_of, commit, rollback, cache_prefill...)."""

    @property
    def stats(self) -> SchedulerStats: ...

    def place(self, req: Req, where: Place) -> None:
        """Put `req` at `where` in the request table (or move it there)."""

    def find(self, pred: Callable[[Req], bool], *places: Place) -> list[Req]: ...

    def stop(self, req: Req, reason: FinishReason) -> str:
        """End `req` now, or when the launched batch holding it is processed."""

    def finish(self, req: Req, reason: FinishReason, insert: bool = True) -> None:
        """The terminal state of a request in no place (or one just removed from its place)."""

    def advance(self, req: Req, tokens: Sequence[int], logprobs: Sequence[float | None],
                top_logprobs: Sequence[list[tuple[float, int]] | None], grammar_status: str | None) -> int:
        """Accept a forward's tokens for `req` one at a time through the finish rules (under
        the error boundary); returns how many were kept."""

    def stream_if_due(self, req: Req) -> None: ...

    def emit(self, req: Req) -> None:
        """Queue `req`'s output so far for the front end (sent by `flush`)."""

    def flush(self) -> None: ...

    def now(self) -> float:
        """The clock timeouts and queue order go by (rank 0's under tensor parallelism)."""


class StepHooks:
    """What the scheduler calls on a plug-in; every hook does nothing unless overridden.
    Handed to the scheduler's constructor, which `bind`s each to itself."""

    def bind(self, ops: RequestOps) -> None:
        """The port this plug-in acts through (called once, by the scheduler's constructor)."""

    def poll(self) -> None:
        """Top of every iteration."""

    def take_new(self, req: Req) -> bool:
        """A new request passed validation; True when the hook placed (or ended) it."""
        return False

    def take_prefilled(self, req: Req) -> bool:
        """`req`'s prefill is done and its first token accepted (or it finished on it); True
        when the hook placed it."""
        return False

    def on_finish(self, req: Req) -> None:
        """`req` ends (any reason), before its KV is released."""

    def info(self) -> dict[str, Any]:
        """Entries of server_info."""
        return {}


class TransferHooks(StepHooks):
    """A prefill/decode disaggregation side (radixlm/disaggregation): it moves requests in and
    out of `Place.TRANSFER` and ends them through `RequestOps.stop` (or `finish` for one in no
    place) like everything else; the scheduler knows nothing of rooms or links."""

    def reject(self, rooms: list[tuple[str, int, int, int]], message: str, status_code: int) -> None:
        """The front end refused a request with these rooms: answer the peer's side of each."""
        raise NotImplementedError

    def busy(self) -> bool:
        """Rooms in progress: the loop should wake on the peers' messages."""
        raise NotImplementedError

    def wait_sockets(self) -> list[Any]:
        """The sockets the idle loop also waits on."""
        raise NotImplementedError

    def stats(self) -> dict[str, Any]:
        """Counters for server_info (under "disaggregation") and /metrics."""
        raise NotImplementedError

    def info(self) -> dict[str, Any]:
        return {"disaggregation": self.stats()}


class InfoHook(StepHooks):
    """Only entries of server_info, from the process around the scheduler (its GC counters)."""

    def __init__(self, entries: Callable[[], dict[str, Any]]) -> None:
        self.entries = entries

    def info(self) -> dict[str, Any]:
        return self.entries()


class ControlOps(RequestOps, Protocol):
    """The port plus the scheduler's control surface: what the message handlers (control.py)
    and server_info use."""

    @property
    def runner(self) -> ModelRunnerProtocol: ...
    @property
    def hooks(self) -> Sequence[StepHooks]: ...
    @property
    def transfer(self) -> TransferHooks | None: ...
    @property
    def grammar_queue(self) -> GrammarQueue: ...
    @property
    def ratio(self) -> NewTokenRatioTracker: ...
    @property
    def timer(self) -> ForwardTimer: ...
    @property
    def cancel_latency(self) -> CancelLatency: ...
    @property
    def overlap(self) -> bool: ...
    @property
    def paused(self) -> bool: ...
    @property
    def chunked_req(self) -> Req | None: ...
    @property
    def sessions(self) -> SessionTable: ...
    @property
    def requests(self) -> RequestTable:
        """Where every request is (read by the handlers; moves go through the methods)."""
    def add_request(self, msg: TokenizedGenerateReq) -> None: ...
    def reject(self, msg: TokenizedGenerateReq, exc: BaseException) -> None: ...
    def abort(self, msg: AbortReq) -> int: ...
    def pause(self, mode: str) -> bool: ...
    def resume(self) -> bool: ...
    def sync(self) -> None: ...
    def retract(self, req: Req) -> None: ...
    def is_idle(self) -> bool: ...
    def flush_cache(self) -> bool: ...
    def forget_drafts(self) -> None: ...
    def open_session(self, capacity: int, timeout: float | None, session_id: str | None) -> str: ...
    def close_session(self, sid: str, why: str = ...) -> None: ...
    def check_integrity(self) -> None: ...
