"""The request table: where every request the scheduler knows is, in one place.

A request is in exactly one place from `add_request` until it is answered (and, if a launched
batch still writes its KV, until that batch is processed):

    GRAMMAR    its grammar is compiling (no KV)
    WAITING    queued, or retracted and waiting to resume (no KV)
    PREFILL    in a launched prefill batch whose result is not processed yet (holds KV)
    CHUNKED    between two chunks of its prefill (holds KV; at most one request)
    RUNNING    decoding (holds KV; may also sit in a launched decode batch)
    RELEASING  answered; its KV goes back once the launched batch that writes it is processed
    TRANSFER   disaggregation: its KV is being sent (prefill server) or received (decode server;
               it may wait there for slots, holding none)

Each place keeps arrival order (a dict per place), which is the order of the old per-place
lists: the waiting queue's order feeds the scheduling policies and the running order is the
decode batch's order.
"""
from __future__ import annotations

import enum
from collections.abc import Callable, Iterator

from radixlm.core import Req

__all__ = ["Place", "RequestTable", "HOLDS_KV"]


class Place(enum.Enum):
    GRAMMAR = "grammar"
    WAITING = "waiting"
    PREFILL = "prefill"
    CHUNKED = "chunked"
    RUNNING = "running"
    RELEASING = "releasing"
    TRANSFER = "transfer"


# The places whose requests hold KV (check_integrity's live requests).
HOLDS_KV = (Place.PREFILL, Place.CHUNKED, Place.RUNNING, Place.RELEASING, Place.TRANSFER)


class RequestTable:
    def __init__(self) -> None:
        self._where: dict[Req, Place] = {}
        self._places: dict[Place, dict[Req, None]] = {p: {} for p in Place}

    def put(self, req: Req, place: Place) -> None:
        """Add `req` at `place`, or move it there (to the end of that place's order)."""
        old = self._where.get(req)
        if old is not None:
            del self._places[old][req]
        self._where[req] = place
        self._places[place][req] = None

    def remove(self, req: Req) -> Place:
        place = self._where.pop(req)
        del self._places[place][req]
        return place

    def discard(self, req: Req) -> Place | None:
        return self.remove(req) if req in self._where else None

    def where(self, req: Req) -> Place | None:
        return self._where.get(req)

    def reqs(self, *places: Place) -> list[Req]:
        """The requests at `places`, place by place in the order given, each in arrival order."""
        return [r for p in places for r in self._places[p]]

    def find(self, pred: Callable[[Req], bool], *places: Place) -> list[Req]:
        return [r for r in self.reqs(*places) if pred(r)]

    def first(self, place: Place) -> Req | None:
        return next(iter(self._places[place]), None)

    def count(self, *places: Place) -> int:
        return sum(len(self._places[p]) for p in places)

    def __contains__(self, req: Req) -> bool:
        return req in self._where

    def __len__(self) -> int:
        return len(self._where)

    def __iter__(self) -> Iterator[Req]:
        return iter(self._where)
