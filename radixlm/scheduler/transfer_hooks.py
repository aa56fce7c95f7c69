"""What the scheduler calls on a prefill/decode disaggregation side (radixlm/disaggregation).

The scheduler knows nothing of rooms or links: with `--disaggregation-mode prefill|decode` the
scheduler process gives it an object with these hooks, which moves requests in and out of
`Place.TRANSFER` and ends them through `Scheduler.stop` (or `Scheduler.finish` for one in no
place) like everything else.
"""
from __future__ import annotations

from typing import Any, Protocol

from radixlm.core import Req

__all__ = ["TransferHooks"]


class TransferHooks(Protocol):
    def poll(self) -> None:
        """Top of every iteration: messages from the peers, sends, timeouts."""

    def take_new(self, req: Req) -> bool:
        """A new request passed validation; True when the hooks placed it (decode: it waits
        for its KV in Place.TRANSFER instead of the waiting queue)."""

    def take_prefilled(self, req: Req) -> bool:
        """`req`'s prefill is done and its first token appended (or it finished on it); True
        when the hooks placed it (prefill: Place.TRANSFER until its KV is sent and acked)."""

    def on_finish(self, req: Req) -> None:
        """`req` ends (any reason), before its KV is released: forget its room, tell the peer."""

    def reject(self, rooms: list[tuple[str, int, int, int]], message: str, status_code: int) -> None:
        """The front end refused a request with these rooms: answer the peer's side of each."""

    def busy(self) -> bool:
        """Rooms in progress: the loop should wake on the peers' messages."""

    def wait_sockets(self) -> list[Any]:
        """The sockets the idle loop also waits on."""

    def stats(self) -> dict[str, Any]:
        """Counters for server_info and /metrics."""
