"""A prefill scheduler and a decode scheduler (fake runners whose KV records tokens) joined by an
in-memory wire that can delay, drop, duplicate and reorder messages, with a fake clock.

The fake runner asserts on every forward that a request reads only its own tokens, so a chunk
written into another request's slots, or a decode from KV that did not arrive, fails loudly."""
from __future__ import annotations

import random
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from radixlm.disaggregation.common import TransferConfig
from radixlm.disaggregation.decode_side import DecodeTransfer
from radixlm.disaggregation.prefill_side import PrefillTransfer
from radixlm.disaggregation.protocol import decode
from radixlm.messages import AbortReq, TokenizedGenerateReq
from radixlm.sampling_params import SamplingParams

from test.support.hicache_harness import HiHarness, make_hi_harness
from test.support.scheduler_harness import Harness, make_harness

PREFILL_PEER = ("prefill", 1)  # the decode side's name for the prefill server
DECODE_PEER = b"decode"  # the prefill side's name for the decode server

# fault(direction, header) -> "deliver" | "drop" | "dup" | "hold"; direction "p2d" or "d2p"
Fault = Callable[[str, tuple], str]


@dataclass
class Wire:
    fault: Fault | None = None
    reorder: random.Random | None = None
    queues: dict[str, list] = field(default_factory=lambda: {"p2d": [], "d2p": []})
    held: dict[str, list] = field(default_factory=lambda: {"p2d": [], "d2p": []})
    dead: set[str] = field(default_factory=set)  # "prefill" / "decode": that side sends and hears nothing
    sent: dict[str, int] = field(default_factory=lambda: {"p2d": 0, "d2p": 0})

    def put(self, direction: str, frames: list[bytes]) -> None:
        if ("prefill" if direction == "p2d" else "decode") in self.dead:
            return
        self.sent[direction] += 1
        action = self.fault(direction, decode(frames)[0]) if self.fault is not None else "deliver"
        if action == "drop":
            return
        if action == "hold":
            self.held[direction].append(frames)
            return
        self.queues[direction].append(frames)
        if action == "dup":
            self.queues[direction].append(list(frames))

    def take(self, direction: str) -> list[list[bytes]]:
        if ("decode" if direction == "p2d" else "prefill") in self.dead:
            self.queues[direction].clear()
            return []
        out, self.queues[direction] = self.queues[direction], []
        if self.reorder is not None:
            self.reorder.shuffle(out)
        return out

    def release(self, direction: str) -> None:
        """Deliver everything held (late messages)."""
        self.queues[direction] += self.held[direction]
        self.held[direction] = []


@dataclass
class WireEnd:
    wire: Wire
    side: str  # "prefill" or "decode"

    def send(self, peer: Hashable, frames: list[bytes]) -> bool:
        self.wire.put("p2d" if self.side == "prefill" else "d2p", frames)
        return True

    def recv_all(self):
        direction = "d2p" if self.side == "prefill" else "p2d"
        peer = DECODE_PEER if self.side == "prefill" else PREFILL_PEER
        return [(peer, f) for f in self.wire.take(direction)]

    def sockets(self) -> list:
        return []

    def close(self) -> None:
        pass


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@dataclass
class PDPair:
    p: Harness
    d: Harness
    ptx: PrefillTransfer
    dtx: DecodeTransfer
    wire: Wire
    clock: Clock
    rooms: int = 0

    def submit(self, prompt: list[int], rid: str, *, room: int | None = None, n: int = 1,
               to: tuple[str, ...] = ("prefill", "decode"), **sp) -> int:
        if room is None:
            self.rooms += 1
            room = self.rooms
        for i in range(n):
            child = rid if n == 1 else f"{rid}_{i}"
            for side in to:
                h = self.p if side == "prefill" else self.d
                h.scheduler.add_request(TokenizedGenerateReq(
                    rid=child, input_ids=list(prompt), sampling_params=SamplingParams.from_dict(sp),
                    bootstrap=(PREFILL_PEER[0], PREFILL_PEER[1], room, i)))
        return room

    def abort(self, side: str, rid: str) -> None:
        (self.p if side == "prefill" else self.d).scheduler.abort(AbortReq(rids=[rid]))

    def step(self) -> bool:
        busy = False
        for h in (self.p, self.d):
            moved = h.scheduler.step()
            h.scheduler.check_integrity()
            if isinstance(h, HiHarness):
                h.check()  # every settled host/device copy holds its node's tokens
                if not moved:
                    h.settle()  # host copies land and their acks are processed
            busy = moved or busy
        return busy

    def idle(self) -> bool:
        return self.p.scheduler.is_idle() and self.d.scheduler.is_idle() and not any(self.wire.queues.values())

    def run(self, max_steps: int = 20_000, advance: float | None = None) -> None:
        """Until both sides are idle. When nothing moves, the clock jumps past the timeout
        (`advance`, default timeout + 1 s), so a silent peer is detected."""
        jump = advance if advance is not None else self.ptx.config.timeout_s + 1.0
        quiet = 0
        for _ in range(max_steps):
            if self.idle():
                return
            moving = self.step() or any(self.wire.queues.values())
            quiet = 0 if moving else quiet + 1
            if quiet >= 3:
                self.clock.t += jump
                quiet = 0
        raise AssertionError("the pair did not become idle")

    def assert_clean(self) -> None:
        for h in (self.p, self.d):
            h.assert_idle_and_conserved()
        assert not self.ptx.rooms and not self.dtx.rooms, (self.ptx.rooms, self.dtx.rooms)
        assert not self.ptx.early


def make_pair(*, overlap: bool = False, fault: Fault | None = None, reorder_seed: int | None = None,
              timeout_s: float = 30.0, chunk_tokens: int = 4, p_args: dict | None = None,
              d_args: dict | None = None, decode_hicache: bool = False) -> PDPair:
    o = {"disable_overlap_schedule": not overlap, "enable_overlap_schedule": overlap}
    wire = Wire(fault, random.Random(reorder_seed) if reorder_seed is not None else None)
    config = TransferConfig(timeout_s=timeout_s, ping_s=1.0, chunk_tokens=chunk_tokens)
    built: dict[str, Harness] = {}  # each side's KV is its harness's runner's, built with the scheduler
    ptx = PrefillTransfer(WireEnd(wire, "prefill"), lambda: [built["p"].runner.kv], config)
    dtx = DecodeTransfer(WireEnd(wire, "decode"), lambda: [built["d"].runner.kv], config)
    clock = Clock()
    ptx.peers.clock = dtx.peers.clock = clock
    p = built["p"] = make_harness(features={"transfer": ptx}, **{**o, **(p_args or {})})
    d = built["d"] = (make_hi_harness if decode_hicache else make_harness)(features={"transfer": dtx},
                                                                           **{**o, **(d_args or {})})
    return PDPair(p, d, ptx, dtx, wire, clock)
