"""The transfer protocol between a decode server (D) and a prefill server (P).

A transfer is keyed by its room only: `RoomKey(room, child)`, the gateway's `bootstrap_room`
and the request's index among the n > 1 children the room's request expands to (the gateway
gives one room per request, whatever its n). Every message is a list of frames: a JSON header (a
list whose first element is the kind; JSON, not pickle: a peer's bytes are never code) and,
for KV, one raw payload frame.

D -> P: HELLO (D holds a request for the room), WANT (slots are allocated: send tokens
[start, start + count) in chunks of `chunk_tokens`), ACK (every chunk arrived), ABORT, PING.
P -> D: KV (one chunk: buffer b, tokens [start + c * chunk_tokens, ...)), DONE (the number of
chunks, the first token and its logprobs), ABORT, PING.
"""
from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from typing import Any, NamedTuple

__all__ = ["RoomKey", "Bootstrap", "bootstrap_of", "room_key", "HELLO", "WANT", "ACK", "ABORT", "PING", "KV", "DONE",
           "encode", "decode", "checksum", "num_chunks"]

HELLO, WANT, ACK, ABORT, PING, KV, DONE = "hello", "want", "ack", "abort", "ping", "kv", "done"


class RoomKey(NamedTuple):
    room: int
    child: int = 0  # index among the n > 1 children


@dataclass(frozen=True)
class Bootstrap:
    """Where a request's KV comes from (decode) or which room it is sent to (prefill)."""
    host: str
    port: int
    room: int
    index: int = 0

    @property
    def key(self) -> RoomKey:
        return RoomKey(self.room, self.index)


def bootstrap_of(req: Any) -> Bootstrap | None:
    """A request's room: the scheduler keeps the (host, port, room, index) tuple it was sent."""
    b = req.bootstrap
    return None if b is None else b if isinstance(b, Bootstrap) else Bootstrap(*b)


def room_key(req: Any) -> RoomKey:
    boot = bootstrap_of(req)
    assert boot is not None, "a request without a room"
    return boot.key


def encode(*header: Any, payload: bytes | None = None) -> list[bytes]:
    frames = [json.dumps(header, separators=(",", ":")).encode()]
    if payload is not None:
        frames.append(payload)
    return frames


def decode(frames: list[bytes]) -> tuple[tuple[Any, ...], bytes | None]:
    """(header, payload); raises ValueError on a malformed message."""
    if not frames or len(frames) > 2:
        raise ValueError(f"a message has 1 or 2 frames, got {len(frames)}")
    try:
        header = json.loads(frames[0])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"malformed header: {e}") from None
    if not isinstance(header, list) or not header or not isinstance(header[0], str):
        raise ValueError("malformed header")
    return tuple(header), (frames[1] if len(frames) == 2 else None)


def checksum(payload: bytes) -> int:
    return zlib.crc32(payload)


def num_chunks(count: int, chunk_tokens: int) -> int:
    return -(-count // chunk_tokens) if count > 0 else 0
