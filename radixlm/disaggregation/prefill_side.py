"""The prefill server's side of a room: compute the prompt, send its KV, hold it until acked.

A request with a room is scheduled as usual (the radix cache and HiCache serve its prefix, so
a shared prefix is computed once and sent many times). When its prefill is done and its first
token sampled, it moves to `Place.TRANSFER` instead of decoding: its prompt KV is published in
the tree (`cache_prefill`) and stays locked by the request, its unaligned tail stays its own.
Once the decode server's WANT names the token range it needs, every chunk is sent and then
DONE with the first token; the request ends (its one exit, `RequestOps.stop`) only on the
decode server's ACK, its ABORT, or a timeout. So its source pages are held until the transfer
is done or cancelled: what a one-sided (RDMA) backend, which reads them after `send`
returns, needs (docs/disaggregation.md).

Ending the other way: whatever ends the request before the ACK (client abort, timeout, an
over-long prompt refused at admission, out of memory) reaches the decode server as ABORT with
its message and status; if the decode server has not said HELLO yet, the room keeps a
tombstone and answers its HELLO or WANT with that ABORT.
"""
from __future__ import annotations

import logging
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from radixlm.core import FinishReason, Req
from radixlm.disaggregation.common import TransferSide
from radixlm.disaggregation.kv_pages import layout, read_chunk
from radixlm.disaggregation.protocol import (ABORT, ACK, DONE, HELLO, KV, WANT, RoomKey, bootstrap_of, checksum,
                                             encode, num_chunks, room_key)
from radixlm.scheduler.requests import Place

__all__ = ["PrefillTransfer"]

logger = logging.getLogger(__name__)


@dataclass
class Want:
    start: int
    count: int
    chunk_tokens: int
    layout: list[int]


@dataclass
class PrefillRoom:
    req: Req
    peer: Hashable | None = None
    want: Want | None = None
    prefilled: bool = False  # in Place.TRANSFER, its KV complete
    sent: bool = False
    acked: bool = False
    peer_aborted: bool = False
    first_finish: FinishReason | None = None  # it finished on its first token (eos, stop, length 1)
    since: float = 0.0


@dataclass
class Early:
    """A HELLO or WANT that came before the request itself."""
    peer: Hashable
    since: float
    want: Want | None = None


@dataclass
class PrefillTransfer(TransferSide):
    rooms: dict[RoomKey, PrefillRoom] = field(default_factory=dict)
    early: dict[RoomKey, Early] = field(default_factory=dict)
    tombstones: dict[RoomKey, tuple[str, int, float]] = field(default_factory=dict)

    # ------------------------------------------------------------ scheduler hooks
    def take_new(self, req: Req) -> bool:
        if bootstrap_of(req) is None:
            return False
        key = room_key(req)
        if key in self.rooms:
            self.ops.finish(req, FinishReason.abort(f"bootstrap room {key.room} is already in use", 400))
            return True
        room = PrefillRoom(req, since=self.clock())
        early = self.early.pop(key, None)
        if early is not None:
            room.peer, room.want = early.peer, early.want
        self.rooms[key] = room
        self.counters.rooms_started += 1
        return False  # scheduled as any request

    def take_prefilled(self, req: Req) -> bool:
        room = self._room(req)
        if room is None or not req.output_ids or (req.finish_reason is not None and req.finish_reason.type == "abort"):
            return False
        room.first_finish, req.finish_reason = req.finish_reason, None  # it ends when acked
        self.ops.cache.cache_prefill(req)  # shared with later requests; still locked by this one
        self.ops.place(req, Place.TRANSFER)
        room.prefilled, room.since = True, self.clock()
        self._try_send(room)
        return True

    def on_finish(self, req: Req) -> None:
        room = self._room(req)
        if room is None:
            if bootstrap_of(req) is not None and req.finish_reason is not None and req.finish_reason.type == "abort":
                self._tombstone(room_key(req), req.finish_reason)  # refused before it had a room
            return
        key = room_key(req)
        del self.rooms[key]
        if room.acked or room.peer_aborted:
            # a late HELLO/WANT (reordered, duplicated) for it is dropped, not taken for a new room
            self.tombstones[key] = ("", 0, self.clock())
            return
        self.counters.rooms_aborted += 1
        reason = req.finish_reason or FinishReason.abort("the prefill server ended the request", 500)
        if reason.type != "abort":
            reason = FinishReason.abort(f"the prefill server ended the request ({reason.type}) before "
                                        "its KV was sent", 500)
        if room.peer is not None:
            self._send_abort(room.peer, key, reason)
            self.tombstones[key] = ("", 0, self.clock())
        else:
            self._tombstone(key, reason)

    def reject(self, rooms: list[tuple[str, int, int, int]], message: str, status_code: int) -> None:
        for boot in rooms:
            self._tombstone(RoomKey(boot[2], boot[3]), FinishReason.abort(message, status_code))

    def poll(self) -> None:
        self.peers.dispatch(self.counters, self._on_message)
        self._expire()
        self.peers.ping({r.peer for r in self.rooms.values() if r.peer is not None})

    def busy(self) -> bool:
        return bool(self.rooms or self.early)

    def stats(self) -> dict[str, Any]:
        return {"mode": "prefill", "rooms": len(self.rooms), **self.counters.as_dict()}

    # ------------------------------------------------------------ messages
    def _on_message(self, peer: Hashable, header: tuple[Any, ...], payload: bytes | None) -> None:
        kind, key = header[0], RoomKey(int(header[1][0]), int(header[1][1]))
        room = self.rooms.get(key)
        if kind in (HELLO, WANT):
            want = Want(int(header[2]), int(header[3]), int(header[4]), list(header[5])) if kind == WANT else None
            if room is not None:
                room.peer, room.since = peer, self.clock()
                if want is not None:
                    room.want = want
                    self._try_send(room)
            elif key in self.tombstones:
                message, status, _ = self.tombstones[key]
                if status:  # ended here before the decode server asked: tell it (once)
                    self.tombstones[key] = ("", 0, self.clock())
                    self._send_abort(peer, key, FinishReason.abort(message, status))
                else:
                    self.counters.dropped_messages += 1
            else:
                old = self.early.get(key)
                self.early[key] = Early(peer, self.clock(), want or (old.want if old else None))
        elif kind == ACK:
            if room is not None and room.sent:
                room.acked = True
                self.counters.rooms_completed += 1
                req = room.req
                reason = room.first_finish or FinishReason("length", length=len(req.output_ids))
                self.ops.stop(req, reason)
        elif kind == ABORT:
            self.early.pop(key, None)
            if room is not None:
                room.peer_aborted = True
                self.counters.rooms_aborted_by_peer += 1
                if room.req.to_finish is None and not room.req.finished:
                    self.ops.stop(room.req, FinishReason.abort(f"the decode server ended it: {header[2]}",
                                                                     int(header[3])))
        else:
            self.counters.dropped_messages += 1

    def _try_send(self, room: PrefillRoom) -> None:
        if not (room.prefilled and room.want is not None) or room.sent:
            return
        req, want, key = room.req, room.want, room_key(room.req)
        buffers = self.kv_buffers()
        n_prompt = len(req.origin_input_ids)
        error = None
        if want.layout != layout(buffers):
            error = "the decode server's KV layout differs (another model or KV dtype)"
        elif want.start < 0 or want.start + want.count != n_prompt or want.chunk_tokens < 1:
            error = f"the decode server asked for tokens [{want.start}, {want.start + want.count}) of {n_prompt}"
        if error is not None:
            self.ops.stop(req, FinishReason.abort(error, 500))
            return
        slots = self.ops.cache.slots_of(req, want.start, want.count)
        n = num_chunks(want.count, want.chunk_tokens)
        ok = True
        for b, buf in enumerate(buffers):
            for c in range(n):
                payload = read_chunk(buf, slots[c * want.chunk_tokens:(c + 1) * want.chunk_tokens])
                ok = ok and self.link.send(room.peer, encode(KV, key, b, c, checksum(payload), payload=payload))
                self.counters.bytes += len(payload)
                self.counters.chunks += 1
        lp = req.output_token_logprobs[0][0] if req.return_logprob else None
        top = req.output_top_logprobs[0] if req.return_logprob and req.keeps_top_lists else None
        ok = ok and self.link.send(room.peer, encode(DONE, key, n * len(buffers), req.output_ids[0], lp, top))
        room.sent, room.since = True, self.clock()
        if not ok:
            self.ops.stop(req, FinishReason.abort("the decode server cannot be reached", 503))

    def _expire(self) -> None:
        now, limit = self.clock(), self.config.timeout_s
        for room in [r for r in self.rooms.values() if r.prefilled and not r.acked]:
            if self.peers.silent_since(room.peer, room.since) > limit and room.req.to_finish is None:
                self.counters.rooms_timed_out += 1
                what = "asked for its KV" if room.want is None else "acknowledged its KV"
                self.ops.stop(room.req, FinishReason.abort(
                    f"KV transfer timed out: the decode server never {what} within {limit:g} s", 503))
        for key, early in list(self.early.items()):
            if now - early.since > limit:  # the request never came here
                del self.early[key]
                self.counters.rooms_timed_out += 1
                self._send_abort(early.peer, key, FinishReason.abort(
                    "the prefill server never received this request", 503))
        for key, (_, _, t) in list(self.tombstones.items()):
            if now - t > limit:
                del self.tombstones[key]

    # ------------------------------------------------------------ helpers
    def _room(self, req: Req) -> PrefillRoom | None:
        if bootstrap_of(req) is None:
            return None
        room = self.rooms.get(room_key(req))
        return room if room is not None and room.req is req else None

    def _send_abort(self, peer: Hashable, key: RoomKey, reason: FinishReason) -> None:
        self.link.send(peer, encode(ABORT, key, reason.message or "aborted", reason.status_code or 500))

    def _tombstone(self, key: RoomKey, reason: FinishReason) -> None:
        self.tombstones[key] = (reason.message or "aborted", reason.status_code or 500, self.clock())
        self.counters.rooms_aborted += 1
        early = self.early.pop(key, None)
        if early is not None:
            self._send_abort(early.peer, key, reason)
            self.tombstones[key] = ("", 0, self.clock())


