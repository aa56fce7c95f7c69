"""Plug-ins through the port alone: speculation and the decode side of prefill/decode
disaggregation driven by a fake `RequestOps` (a request table, a real cache manager over a
fake KV-recording model, the one acceptance path), with no `Scheduler` anywhere.

What the plug-ins must do through the port: accept tokens with `advance`, settle requests with
settle.py, commit and roll back KV through the cache manager, read and write KV slots with
`slots_of`, and end requests with `stop`/`finish`; the fake checks every KV slot's owner after
each step (the cache manager's integrity check) and that no slot outlives its request.
"""
from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import torch

from radixlm.core import FinishReason, Req
from radixlm.disaggregation.common import TransferConfig
from radixlm.disaggregation.decode_side import DecodeTransfer
from radixlm.disaggregation.kv_pages import read_chunk
from radixlm.disaggregation.protocol import ACK, DONE, HELLO, KV, WANT, checksum, decode, encode
from radixlm.messages import ReqOutput
from radixlm.radix_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
from radixlm.radix_cache.radix_cache import RadixCache
from radixlm.sampling_params import SamplingParams
from radixlm.scheduler.batch_builder import prefill_batch
from radixlm.scheduler.cache_manager import CacheManager
from radixlm.scheduler.output import StopStringChecker, make_output
from radixlm.scheduler.port import RequestOps, StepHooks
from radixlm.scheduler.prefill import PrefillAdder
from radixlm.scheduler.requests import HOLDS_KV, Place, RequestTable
from radixlm.scheduler.settle import accept, settle_prefilled
from radixlm.scheduler.speculation import Speculation
from radixlm.scheduler.stats import SchedulerStats
from radixlm.speculative.drafter import NgramConfig

from test.support.fake_runner import FakeRunner, reference_output

CAPACITY = 512
V = 13  # memory=1 below: the fake's text cycles through this vocabulary, so drafts get accepted


@dataclass
class FakePort:
    """RequestOps without a scheduler: where requests are, their one exit, their outputs."""
    cache: CacheManager
    hooks: list[StepHooks] = field(default_factory=list)
    stats: SchedulerStats = field(default_factory=SchedulerStats)
    table: RequestTable = field(default_factory=RequestTable)
    outputs: dict[str, list[ReqOutput]] = field(default_factory=dict)
    clock: float = 100.0

    def place(self, req: Req, where: Place) -> None:
        self.table.put(req, where)

    def find(self, pred: Callable[[Req], bool], *places: Place) -> list[Req]:
        return self.table.find(pred, *places)

    def stop(self, req: Req, reason: FinishReason) -> str:
        place = self.table.remove(req)
        self.finish(req, reason)
        return place.name.lower()

    def finish(self, req: Req, reason: FinishReason, insert: bool = True) -> None:
        self.table.discard(req)
        req.finish_reason, req.to_finish = reason, None
        for hook in self.hooks:
            hook.on_finish(req)
        if req.req_pool_idx is not None:
            self.cache.release(req, insert=insert)
        self.emit(req)

    def advance(self, req: Req, tokens: Sequence[int], logprobs: Sequence[float | None],
                top_logprobs: Sequence[list[tuple[float, int]] | None], grammar_status: str | None) -> int:
        before = len(req.output_ids)
        accept(req, tokens, logprobs, top_logprobs, grammar_status, StopStringChecker(None))
        return len(req.output_ids) - before

    def stream_if_due(self, req: Req) -> None:
        if len(req.output_ids) > req.sent_len:
            self.emit(req)

    def emit(self, req: Req) -> None:
        self.outputs.setdefault(req.rid, []).append(make_output(req, include_input_logprobs=False))

    def flush(self) -> None:
        pass

    def now(self) -> float:
        return self.clock

    # ---- what the test reads
    def tokens(self, rid: str) -> list[int]:
        return [t for o in self.outputs[rid] for t in o.new_token_ids]

    def final(self, rid: str) -> dict:
        fin = self.outputs[rid][-1].finish_reason
        assert fin is not None and all(o.finish_reason is None for o in self.outputs[rid][:-1])
        return fin

    def check(self) -> None:
        live = self.table.find(lambda r: r.req_pool_idx is not None, *HOLDS_KV)
        self.cache.check_integrity(live)
        for req in live:
            assert req.kv_allocated_len == req.kv_committed_len, f"{req.rid}: a draft slot outlived its step"

    def assert_clean(self) -> None:
        assert not self.table
        self.check()
        assert self.cache.protected() == 0
        assert self.cache.available() + self.cache.evictable() == self.cache.capacity


def _world(eos: tuple[int, ...] = ()) -> tuple[FakePort, FakeRunner]:
    pool = ReqToTokenPool(8, 256)
    cache = CacheManager(RadixCache(1), pool, TokenToKVPoolAllocator(CAPACITY))
    return FakePort(cache), FakeRunner(CAPACITY, pool, V, 256, eos, memory=1)


def _req(rid: str, prompt: list[int], max_new: int, eos: tuple[int, ...] = (), **kw) -> Req:
    return Req(rid=rid, origin_input_ids=list(prompt), sampling_params=SamplingParams(max_new_tokens=max_new),
               eos_token_ids=frozenset(eos), **kw)


def test_the_plug_ins_load_without_the_scheduler():
    """Importing speculation, both disaggregation sides, the error boundary and the control
    handlers loads neither the Scheduler nor its request lifecycle."""
    code = ("import sys\n"
            "import radixlm.scheduler.speculation, radixlm.scheduler.error_boundary, radixlm.scheduler.control\n"
            "import radixlm.disaggregation.decode_side, radixlm.disaggregation.prefill_side\n"
            "import radixlm.disaggregation.build\n"
            "loaded = {'radixlm.scheduler.scheduler', 'radixlm.scheduler.lifecycle'} & set(sys.modules)\n"
            "assert not loaded, loaded\n")
    subprocess.run([sys.executable, "-c", code], check=True)
    port: RequestOps = _world()[0]  # the fake is what the plug-ins are typed against
    assert port.now() == 100.0


def _prefill(port: FakePort, runner: FakeRunner, reqs: list[Req]) -> None:
    """Admission and a prefill forward, settled through the port (what the scheduler does)."""
    adder = PrefillAdder(port.cache, [], 1.0, 4096, None, 8, 1)
    for req in reqs:
        adder.add_one_req(req)
    plan = adder.plan
    assert plan.reqs == reqs
    batch = prefill_batch(plan)
    result = runner.forward(batch)
    for i, req in enumerate(batch.reqs):
        port.cache.commit(req, batch.extend_lens[i])
        port.advance(req, result.next_token_ids[i:i + 1], result.logprobs[i:i + 1], result.top_logprobs[i:i + 1],
                     None)
        settle_prefilled(port, req)
    port.check()


def _speculate(port: FakePort, runner: FakeRunner, spec: Speculation, before_result=None) -> int:
    steps = 0
    while running := port.table.reqs(Place.RUNNING):
        batch = spec.batch(running)
        result = runner.forward(batch)
        if before_result is not None:
            before_result(steps, batch)
        spec.process_result(port, batch, result)
        port.check()
        steps += 1
    return steps


def test_speculation_through_the_port_gives_plain_decoding_and_returns_every_draft_slot():
    port, runner = _world()
    spec = Speculation(NgramConfig(num_draft_tokens=4), port.cache, runner.max_context_len, V)
    spec.bind(port)
    port.hooks.append(spec)
    prompts = {f"r{i}": [(3 * i + j) % V for j in range(5 + i)] for i in range(3)}
    max_new = {rid: 20 + 3 * i for i, rid in enumerate(prompts)}
    reqs = [_req(rid, p, max_new[rid]) for rid, p in prompts.items()]
    for req in reqs:
        spec.state(req)
    _prefill(port, runner, reqs)
    steps = _speculate(port, runner, spec)
    for rid, p in prompts.items():
        assert port.tokens(rid) == reference_output(p, max_new[rid], V, 1)
        assert port.final(rid)["type"] == "length"
    # drafts were accepted: fewer verify steps than tokens, and the stats say so
    assert steps < max(max_new.values()) - 1
    assert spec.stats.spec_accepted_tokens > 0 and port.stats.num_decode_tokens > 0
    port.assert_clean()


def test_speculation_through_the_port_ends_a_run_at_eos_and_drops_an_aborted_row():
    prompt = [1, 2, 3, 4]
    ref = reference_output(prompt, 40, V, 1)
    eos = ref[12]
    port, runner = _world(eos=(eos,))
    spec = Speculation(NgramConfig(num_draft_tokens=4), port.cache, runner.max_context_len, V)
    spec.bind(port)
    ended = _req("eos", prompt, 40, eos=(eos,))
    aborted = _req("abort", [5, 6, 7], 40)
    for req in (ended, aborted):
        spec.state(req)
    _prefill(port, runner, [ended, aborted])
    delivered: dict[str, int] = {}

    def abort_at_step_three(step: int, batch) -> None:  # the abort arrives while the step runs
        if step == 3:
            aborted.to_finish = FinishReason.abort()
            delivered["abort"] = len(aborted.output_ids)
    _speculate(port, runner, spec, abort_at_step_three)
    assert port.tokens("eos") == ref[:ref.index(eos) + 1]
    assert port.final("eos") == {"type": "stop", "matched": eos}
    assert port.final("abort")["type"] == "abort"
    assert len(port.tokens("abort")) == delivered["abort"]  # the aborted step's tokens are dropped
    assert spec.stats.spec_dropped_steps == 1
    port.assert_clean()


@dataclass
class FakeLink:
    """The decode side's link: what it sent, and what the fake prefill server sends it."""
    sent: list[tuple[Hashable, tuple]] = field(default_factory=list)
    inbox: list[list[bytes]] = field(default_factory=list)

    def send(self, peer: Hashable, frames: list[bytes]) -> bool:
        self.sent.append((peer, decode(frames)[0]))
        return True

    def recv_all(self) -> list[tuple[Hashable, list[bytes]]]:
        out, self.inbox = self.inbox, []
        return [(("prefill", 1), f) for f in out]

    def sockets(self) -> list:
        return []

    def close(self) -> None:
        pass

    def kinds(self) -> list[str]:
        return [h[0] for _, h in self.sent]


def _decode_side(eos: tuple[int, ...] = ()) -> tuple[FakePort, FakeRunner, DecodeTransfer, FakeLink]:
    port, runner = _world(eos)
    link = FakeLink()
    side = DecodeTransfer(link, lambda: [runner.kv], TransferConfig(chunk_tokens=4))
    side.bind(port)
    port.hooks.append(side)
    return port, runner, side, link


def _send_prompt_kv(link: FakeLink, want: tuple, prompt: list[int], first: int) -> None:
    """What the prefill server sends for a WANT: the wanted tokens' KV in chunks, then DONE."""
    _, key, start, count, ct, _layout = want
    source = torch.tensor(prompt, dtype=torch.int64)  # the fake KV of a token is the token
    n = 0
    for c, lo in enumerate(range(start, start + count, ct)):
        payload = read_chunk(source, torch.arange(lo, min(lo + ct, start + count)))
        link.inbox.append(encode(KV, key, 0, c, checksum(payload), payload=payload))
        n += 1
    link.inbox.append(encode(DONE, key, n, first, None, None))


def test_decode_side_through_the_port_receives_the_prompt_and_decodes_from_it():
    prompt = list(range(1, 12))
    ref = reference_output(prompt, 6, V, 1)
    port, runner, side, link = _decode_side()
    req = _req("d", prompt, 6, bootstrap=("prefill", 1, 7, 0))
    assert side.take_new(req)
    assert port.table.where(req) is Place.TRANSFER and link.kinds() == [HELLO, WANT]
    want = link.sent[-1][1]
    assert want[2:4] == (0, len(prompt))  # an empty tree here: the whole prompt travels
    _send_prompt_kv(link, want, prompt, ref[0])
    side.poll()
    assert link.kinds()[-1] == ACK
    assert port.table.where(req) is Place.RUNNING and port.tokens("d") == ref[:1]
    assert runner.kv[port.cache.slots_of(req, 0, len(prompt))].tolist() == prompt
    port.check()
    # the rest is decoded here, from the KV that came (the fake model checks what a row reads)
    from radixlm.scheduler.batch_builder import decode_batch
    while running := port.table.reqs(Place.RUNNING):
        batch = decode_batch(running, port.cache, None, False)
        result = runner.forward(batch)
        for i, r in enumerate(batch.reqs):
            port.cache.commit(r, 1)
            port.advance(r, result.next_token_ids[i:i + 1], result.logprobs[i:i + 1], result.top_logprobs[i:i + 1],
                         None)
            if r.finish_reason is not None:
                port.finish(r, r.finish_reason)
        port.check()
    assert port.tokens("d") == ref and port.final("d")["type"] == "length"
    assert side.counters.rooms_completed == 1 and not side.rooms
    port.assert_clean()


def test_decode_side_through_the_port_settles_a_first_token_that_ends_the_request():
    prompt = list(range(2, 9))
    first = reference_output(prompt, 1, V, 1)[0]
    port, runner, side, link = _decode_side(eos=(first,))
    req = _req("e", prompt, 5, eos=(first,), bootstrap=("prefill", 1, 8, 0))
    side.take_new(req)
    _send_prompt_kv(link, link.sent[-1][1], prompt, first)
    side.poll()
    assert port.final("e") == {"type": "stop", "matched": first} and port.tokens("e") == [first]
    assert link.kinds() == [HELLO, WANT, ACK]  # completed: no ABORT for the room
    assert not side.rooms
    port.assert_clean()


def test_decode_side_through_the_port_tells_the_peer_when_the_request_is_stopped():
    port, runner, side, link = _decode_side()
    req = _req("s", list(range(1, 10)), 5, bootstrap=("prefill", 1, 9, 0))
    side.take_new(req)
    port.stop(req, FinishReason.abort("client went away", 499))
    assert link.kinds() == [HELLO, WANT, "abort"] and link.sent[-1][1][2:] == ("client went away", 499)
    # a chunk that arrives later is dropped, never written into slots that may be someone else's
    link.inbox.append(encode(KV, [9, 0], 0, 0, checksum(b"x" * 32), payload=b"x" * 32))
    side.poll()
    assert side.counters.dropped_messages == 1 and (runner.kv == -1).all()
    port.assert_clean()
