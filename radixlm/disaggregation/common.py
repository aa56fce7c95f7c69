"""What both sides share: their settings, counters and the peer bookkeeping (pings, silence)."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable
from dataclasses import asdict, dataclass, field
from typing import Any

from radixlm.disaggregation.kv_pages import KVBuffers
from radixlm.disaggregation.links import Link
from radixlm.disaggregation.protocol import PING, decode, encode
from radixlm.scheduler.port import RequestOps, TransferHooks

__all__ = ["TransferConfig", "TransferStats", "PeerBook", "TransferSide"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TransferConfig:
    # A room whose peer is silent this long (no message, pings included) is ended on this
    # side: its slots are reclaimed and its request answered with a 503.
    timeout_s: float = 30.0
    ping_s: float = 1.0  # each side pings the peers it has rooms with
    chunk_tokens: int = 1024  # tokens per KV chunk (one message per buffer and chunk)


@dataclass
class TransferStats:
    rooms_started: int = 0
    rooms_completed: int = 0
    rooms_aborted: int = 0  # ended before completion on this side (abort sent or recorded)
    rooms_aborted_by_peer: int = 0
    rooms_timed_out: int = 0
    bytes: int = 0  # KV payload sent (prefill) or written (decode)
    chunks: int = 0
    dropped_messages: int = 0  # for a room that is not (or no longer) receiving: never written
    duplicate_chunks: int = 0
    bad_messages: int = 0  # malformed, wrong size or checksum: dropped (the room then times out)
    transfer_seconds: float = 0.0  # sum over completed rooms of first KV chunk -> last one

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


@dataclass
class PeerBook:
    """When each peer was last heard from, and pinging the peers with rooms."""
    link: Link
    config: TransferConfig
    clock: Callable[[], float] = time.monotonic
    heard: dict[Hashable, float] = field(default_factory=dict)
    _last_ping: float = 0.0

    def dispatch(self, stats: TransferStats, handle: Callable[[Hashable, tuple[Any, ...], bytes | None], None]) -> None:
        """Every message waiting now to `handle`; a malformed one is counted and dropped."""
        now = self.clock()
        for peer, frames in self.link.recv_all():
            self.heard[peer] = now
            try:
                header, payload = decode(frames)
                if header[0] != PING:
                    handle(peer, header, payload)
            except (TypeError, ValueError, IndexError) as e:
                stats.bad_messages += 1
                logger.warning("dropped a malformed disaggregation message: %s", e)

    def silent_since(self, peer: Hashable | None, since: float) -> float:
        """Seconds of silence of `peer` for a room whose own last progress was at `since`."""
        last = max(since, self.heard.get(peer, since)) if peer is not None else since
        return self.clock() - last

    def ping(self, peers: set[Hashable]) -> None:
        now = self.clock()
        if now - self._last_ping < self.config.ping_s:
            return
        self._last_ping = now
        for peer in peers:
            self.link.send(peer, encode(PING))


@dataclass
class TransferSide(TransferHooks):
    """What both sides are built from: their link and KV buffers. Built before the scheduler,
    handed to its constructor, which binds it to the port it acts through (`ops`)."""
    link: Link
    kv_buffers: KVBuffers
    config: TransferConfig = field(default_factory=TransferConfig)
    counters: TransferStats = field(default_factory=TransferStats)

    def __post_init__(self) -> None:
        self.peers = PeerBook(self.link, self.config)
        self._ops: RequestOps | None = None

    def bind(self, ops: RequestOps) -> None:
        self._ops = ops

    @property
    def ops(self) -> RequestOps:
        if self._ops is None:
            raise RuntimeError("this disaggregation side was never handed to a scheduler")
        return self._ops

    @property
    def clock(self) -> Callable[[], float]:
        return self.peers.clock

    def wait_sockets(self) -> list[Any]:
        return self.link.sockets()
