"""Builds a Scheduler over real pools and a real prefix cache with the FakeRunner."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from radixlm.config import ServerArgs
from radixlm.messages import BatchTokenOut, ReqOutput, SessionParams, TokenizedGenerateReq
from radixlm.radix_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
from radixlm.radix_cache.no_cache import NoPrefixCache
from radixlm.radix_cache.radix_cache import RadixCache
from radixlm.sampling_params import SamplingParams
from radixlm.scheduler.cache_manager import CacheManager
from radixlm.scheduler.scheduler import Scheduler

from test.support.fake_runner import FakeRunner

_ids = itertools.count()
# Set per test by test/unit/scheduler/conftest.py: run the overlap loop or the normal one.
DEFAULT_OVERLAP = True


@dataclass
class Harness:
    scheduler: Scheduler
    runner: FakeRunner
    cache: CacheManager
    outputs: dict[str, list[ReqOutput]] = field(default_factory=dict)

    def on_output(self, batch: BatchTokenOut) -> None:
        for o in batch.outputs:
            self.outputs.setdefault(o.rid, []).append(o)

    def submit(self, prompt: list[int], rid: str | None = None, stream: bool = False,
               priority: int | None = None, session: SessionParams | None = None, **sp) -> str:
        rid = rid or f"r{next(_ids)}"
        self.scheduler.add_request(TokenizedGenerateReq(rid=rid, input_ids=list(prompt),
                                                        sampling_params=SamplingParams.from_dict(sp),
                                                        stream=stream, priority=priority, session=session))
        return rid

    def run(self, max_steps: int = 100_000) -> None:
        for _ in range(max_steps):
            if not self.scheduler.step():
                return
            self.scheduler.check_integrity()
        raise AssertionError("scheduler did not become idle")

    def tokens(self, rid: str) -> list[int]:
        return [t for o in self.outputs[rid] for t in o.new_token_ids]

    def final(self, rid: str) -> ReqOutput:
        finals = [o for o in self.outputs[rid] if o.finish_reason is not None]
        assert len(finals) == 1, f"{rid}: {len(finals)} terminal outputs"
        assert self.outputs[rid][-1] is finals[0], f"{rid}: output after the terminal one"
        return finals[0]

    def where(self, rid: str) -> str | None:
        """waiting | chunked | running, counting a request inside the launched batch (overlap)
        as where that batch will put it."""
        s = self.scheduler
        if any(r.rid == rid for r in s.waiting):
            return "waiting"
        if s.chunked_req is not None and s.chunked_req.rid == rid:
            return "chunked"
        if s.in_flight is not None:
            b = s.in_flight.batch
            for r, samples in zip(b.reqs, b.sample):
                if r.rid == rid and not r.finished:
                    return "running" if samples else "chunked"
        if any(r.rid == rid for r in s.running):
            return "running"
        return None

    def assert_idle_and_conserved(self) -> None:
        assert self.scheduler.is_idle()
        self.scheduler.check_integrity()
        c = self.cache
        assert c.protected() == 0, "locks left behind"
        assert c.available() + c.evictable() == c.capacity


def make_harness(capacity: int = 2048, max_running: int = 64, chunk: int | None = None,
                 disable_cache: bool = False, page_size: int = 1, vocab: int = 97,
                 context: int = 512, eos: tuple[int, ...] = (), grammar_backend=None, memory: int | None = None,
                 chunk_cost_keys: int | None = None, features: dict | None = None, **args) -> Harness:
    """`features`: what the scheduler's constructor is handed besides (transfer, inbox, hooks...)."""
    args.setdefault("disable_overlap_schedule", not DEFAULT_OVERLAP)
    args.setdefault("enable_overlap_schedule", DEFAULT_OVERLAP)
    server_args = ServerArgs(max_total_tokens=capacity, page_size=page_size,
                             debug_check_integrity=True, **args)
    pool = ReqToTokenPool(max_running + 2, context)
    alloc = TokenToKVPoolAllocator(capacity)
    tree = NoPrefixCache(page_size) if disable_cache else RadixCache(page_size)
    cache = CacheManager(tree, pool, alloc)
    runner = FakeRunner(capacity, pool, vocab, context, eos, memory=memory)
    h = Harness(None, runner, cache)  # type: ignore[arg-type]
    config = server_args.scheduler_config(max_running_requests=max_running, chunked_prefill_size=chunk,
                                          device="cpu", chunk_cost_keys=chunk_cost_keys)
    h.scheduler = Scheduler(config, runner, cache, send_output=h.on_output, grammar_backend=grammar_backend,
                            **(features or {}))
    return h
