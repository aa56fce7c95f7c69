"""The decode server's side of a room: pre-allocate, receive, check whole, then decode.

A request with a room waits in `Place.TRANSFER`. The decode server says HELLO to the prefill
server at once (so either side's abort can reach the other), then, when it can, matches the
prompt in its own radix cache (a multi-turn conversation's earlier turns may be cached
here), binds the request to its slots (the cache manager's `admit` + `extend`, the only KV
bookkeeping) and sends WANT for the rest only: tokens [prefix, prompt length).

The decode process writes every received chunk itself, into the slots of the room's request,
and only while the room is alive here: a room ends (`on_finish`, called by the scheduler's one
exit before it releases the slots) by leaving `rooms`, so a chunk that arrives later, a
duplicate or a reordered one for an ended room is dropped and never written; the slots may be
given to the next request at once. A transfer is complete only when DONE has come and every
chunk of every buffer is accounted for (sizes and checksums checked); then the request
commits its KV, inserts it in its tree, takes its first token from the prefill server and
joins decode. An incomplete transfer never decodes: it is ended by the peer's ABORT or by
the silence timeout (503), and its request answered with that abort, never `length`.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from radixlm.core import FinishReason, Req
from radixlm.disaggregation.common import TransferSide
from radixlm.disaggregation.kv_pages import layout, write_chunk
from radixlm.disaggregation.protocol import (ABORT, ACK, DONE, HELLO, KV, WANT, RoomKey, bootstrap_of, checksum,
                                             encode, num_chunks, room_key)
from radixlm.scheduler.settle import settle_prefilled
from radixlm.scheduler.requests import Place

__all__ = ["DecodeTransfer"]

logger = logging.getLogger(__name__)


@dataclass
class DecodeRoom:
    req: Req
    peer: tuple[str, int]
    since: float
    allocated: bool = False
    start: int = 0
    count: int = 0
    expected: int = 0  # chunks: buffers x chunks per buffer
    received: set[tuple[int, int]] = field(default_factory=set)
    done: tuple[Any, ...] | None = None  # (first token, its logprob, its top logprobs)
    complete: bool = False
    peer_aborted: bool = False
    first_chunk_time: float | None = None


@dataclass
class DecodeTransfer(TransferSide):
    rooms: dict[RoomKey, DecodeRoom] = field(default_factory=dict)

    # ------------------------------------------------------------ scheduler hooks
    def take_new(self, req: Req) -> bool:
        boot = bootstrap_of(req)
        if boot is None or req.sampling_params.max_new_tokens == 0:
            return False  # nothing to decode: computed here
        if req.sampling_params.grammar is not None:
            self.ops.finish(req, FinishReason.abort(
                "structured output is not supported with prefill/decode disaggregation yet", 400))
            return True
        if boot.key in self.rooms:
            self.ops.finish(req, FinishReason.abort(f"bootstrap room {boot.room} is already in use", 400))
            return True
        self.rooms[boot.key] = DecodeRoom(req, (boot.host, boot.port), self.clock())
        self.ops.place(req, Place.TRANSFER)
        self.counters.rooms_started += 1
        self.link.send((boot.host, boot.port), encode(HELLO, boot.key))
        self._allocate()
        return True

    def take_prefilled(self, req: Req) -> bool:
        return False  # a decode server's own prefills (retracted requests) decode here

    def on_finish(self, req: Req) -> None:
        boot = bootstrap_of(req)
        if boot is None or req.sampling_params.max_new_tokens == 0:
            return
        room = self.rooms.get(boot.key)
        if room is not None and room.req is not req:
            return  # another request's room (this one was refused as a duplicate)
        if room is not None:
            del self.rooms[boot.key]  # from now on its chunks are dropped, never written
            if room.complete or room.peer_aborted:
                return
        reason = req.finish_reason or FinishReason.abort()
        self.counters.rooms_aborted += 1
        self.link.send((boot.host, boot.port), encode(ABORT, boot.key, reason.message or reason.type,
                                                      reason.status_code or 200))

    def reject(self, rooms: list[tuple[str, int, int, int]], message: str, status_code: int) -> None:
        for host, port, room, child in rooms:  # the prefill server need not compute them
            self.counters.rooms_aborted += 1
            self.link.send((host, port), encode(ABORT, RoomKey(room, child), message, status_code))

    def poll(self) -> None:
        self.peers.dispatch(self.counters, self._on_message)
        self._allocate()
        self._expire()
        self.peers.ping({r.peer for r in self.rooms.values() if not r.complete})

    def busy(self) -> bool:
        return any(not r.complete for r in self.rooms.values())

    def stats(self) -> dict[str, Any]:
        return {"mode": "decode", "rooms": sum(not r.complete for r in self.rooms.values()),
                **self.counters.as_dict()}

    # ------------------------------------------------------------ allocation
    def _allocate(self) -> None:
        """Bind waiting rooms to slots, in arrival order (the first that does not fit waits)."""
        cache = self.ops.cache
        for key, room in list(self.rooms.items()):
            if room.allocated or room.complete:
                continue
            req = room.req
            match = cache.match(req)
            if not cache.admit(req, match):
                return  # no request slot free
            need = len(req.origin_input_ids) - len(match)
            if not cache.make_room(need) or cache.extend(req, need) is None:
                cache.release(req, insert=False)
                return
            cache.note_admission(req, match)
            req.admit_time = self.ops.now()
            room.allocated, room.since = True, self.clock()
            room.start, room.count = len(match), need
            ct = self.config.chunk_tokens
            room.expected = num_chunks(need, ct) * len(self.kv_buffers())
            self.link.send(room.peer, encode(WANT, key, room.start, need, ct, layout(self.kv_buffers())))

    # ------------------------------------------------------------ messages
    def _on_message(self, peer: Hashable, header: tuple[Any, ...], payload: bytes | None) -> None:
        kind, key = header[0], RoomKey(int(header[1][0]), int(header[1][1]))
        room = self.rooms.get(key)
        live = room is not None and room.allocated and not room.complete and not room.req.finished \
            and room.req.to_finish is None
        if kind == KV:
            if not live or room is None:
                self.counters.dropped_messages += 1
                return
            self._write(room, int(header[2]), int(header[3]), int(header[4]), payload)
        elif kind == DONE:
            if not live or room is None:
                self.counters.dropped_messages += 1
                return
            if int(header[2]) != room.expected:
                self._fail(room, f"the prefill server sent {header[2]} chunks, {room.expected} were expected")
                return
            room.done = (int(header[3]), header[4], [tuple(t) for t in header[5]] if header[5] else None)
            room.since = self.clock()
            self._maybe_complete(room)
        elif kind == ABORT:
            if room is None or room.complete or room.req.finished:
                self.counters.dropped_messages += 1
                return
            room.peer_aborted = True
            self.counters.rooms_aborted_by_peer += 1
            status = int(header[3])
            self.ops.stop(room.req, FinishReason.abort(str(header[2]), status if status != 200 else 500))
        else:
            self.counters.dropped_messages += 1

    def _write(self, room: DecodeRoom, b: int, c: int, crc: int, payload: bytes | None) -> None:
        buffers = self.kv_buffers()
        ct = self.config.chunk_tokens
        if payload is None or not 0 <= b < len(buffers) or not 0 <= c < num_chunks(room.count, ct) \
                or checksum(payload) != crc:
            self.counters.bad_messages += 1
            return
        if (b, c) in room.received:
            self.counters.duplicate_chunks += 1
            return
        lo = room.start + c * ct
        slots = self.ops.cache.slots_of(room.req, lo, min(ct, room.start + room.count - lo))
        try:
            write_chunk(buffers[b], slots, payload)
        except ValueError:
            self.counters.bad_messages += 1
            return
        if room.first_chunk_time is None:
            room.first_chunk_time = time.perf_counter()
        room.received.add((b, c))
        room.since = self.clock()
        self.counters.bytes += len(payload)
        self.counters.chunks += 1
        self._maybe_complete(room)

    def _maybe_complete(self, room: DecodeRoom) -> None:
        if room.done is None or len(room.received) != room.expected:
            return
        ops, req = self.ops, room.req
        room.complete = True
        self.counters.rooms_completed += 1
        if room.first_chunk_time is not None:
            self.counters.transfer_seconds += time.perf_counter() - room.first_chunk_time
        self.link.send(room.peer, encode(ACK, room_key(req)))
        ops.cache.commit(req, room.count)
        token, logprob, top = room.done
        # the prefill server's first token, through the same finish rules as a local one; then
        # what it received is in this server's tree, and it decodes here
        ops.advance(req, [token], [logprob if req.return_logprob else None], [top], None)
        settle_prefilled(ops, req)

    def _fail(self, room: DecodeRoom, message: str) -> None:
        self.ops.stop(room.req, FinishReason.abort(message, 500))

    def _expire(self) -> None:
        limit = self.config.timeout_s
        for room in [r for r in self.rooms.values() if not r.complete]:
            if self.peers.silent_since(room.peer, room.since) > limit and room.req.to_finish is None \
                    and not room.req.finished:
                self.counters.rooms_timed_out += 1
                self.ops.stop(room.req, FinishReason.abort(
                    f"KV transfer timed out: nothing from the prefill server {room.peer[0]}:{room.peer[1]} "
                    f"for {limit:g} s", 503))
