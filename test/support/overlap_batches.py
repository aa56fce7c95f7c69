"""Driving ModelRunner.launch by hand, for the tests of overlap's device-side futures (the
CPU tests and test/gpu use the same batches).

`DeferredCopyStream` is the CPU stand-in for a CUDA forward stream: the host copies of a
launched batch hold poison until its copy-done event is synchronized, so anything that
reads them early sees garbage, and the events record when (and how often) they were waited.
"""
from __future__ import annotations

import threading
import weakref

import torch

from radixlm.core import Req
from radixlm.radix_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
from radixlm.sampling_params import SamplingParams
from radixlm.scheduler.batch import WorkerBatch
from radixlm.scheduler.overlap import placeholder
from radixlm.srt.model_runner.launched import ForwardStream

POISON_INT = -7777


class DeferredEvent:
    def __init__(self, copies: list[tuple[torch.Tensor, torch.Tensor]], index: int, log: list) -> None:
        self._copies = copies
        self.index = index
        self.syncs = 0
        self._log = log

    def synchronize(self) -> None:
        self.syncs += 1
        with torch.inference_mode():  # the copies were made in the launch's inference mode
            for host, value in self._copies:
                host.copy_(value)
        self._copies = []
        self._log.append(("sync", self.index, threading.current_thread().name))


class DeferredCopyStream(ForwardStream):
    def __init__(self) -> None:
        super().__init__("cpu")
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.events: list[DeferredEvent] = []
        self.log: list[tuple[str, int, str]] = []

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        poison = float("nan") if t.is_floating_point() else POISON_INT
        host = torch.full(t.shape, poison, dtype=t.dtype)
        self._pending.append((host, t.clone()))  # the value the device would copy, in stream order
        return host

    def copy_done_event(self) -> DeferredEvent:
        ev = DeferredEvent(self._pending, len(self.events), self.log)
        self._pending = []
        self.events.append(ev)
        self.log.append(("launch", ev.index, threading.current_thread().name))
        return ev


_POOLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def pools(runner) -> tuple[ReqToTokenPool, TokenToKVPoolAllocator]:
    """Request-slot and KV-slot pools over a hand-driven runner's tables (in the server they are
    the cache manager's), one pair per runner."""
    if runner not in _POOLS:
        _POOLS[runner] = (ReqToTokenPool.over(runner.req_to_token), TokenToKVPoolAllocator(runner.sizes.max_total_tokens))
    return _POOLS[runner]


def free_reqs(runner, reqs: list[Req], n_extra: int) -> None:
    """Give back the request slots and the prompt + n_extra KV slots of hand-driven requests."""
    rows, alloc = pools(runner)
    for r in reqs:
        alloc.free(rows.req_to_token[r.req_pool_idx, :len(r.origin_input_ids) + n_extra].clone())
        rows.free(r.req_pool_idx)


def make_req(rid: str, prompt: list[int], runner, return_logprob: bool = False, top_logprobs_num: int = 0,
             **params) -> Req:
    sp = SamplingParams.from_dict({"max_new_tokens": 16, "temperature": 0.0, **params})
    req = Req(rid=rid, origin_input_ids=list(prompt), sampling_params=sp, return_logprob=return_logprob,
              top_logprobs_num=top_logprobs_num, eos_token_ids=frozenset(runner.eos_token_ids))
    req.req_pool_idx = pools(runner)[0].alloc()
    return req


def _place(runner, req: Req, start: int, n: int) -> torch.Tensor:
    rows, alloc = pools(runner)
    loc = alloc.alloc(n)
    assert loc is not None
    rows.req_to_token[req.req_pool_idx, start:start + n] = loc
    return loc


def prefill_batch(runner, reqs: list[Req]) -> WorkerBatch:
    locs = [_place(runner, r, 0, len(r.origin_input_ids)) for r in reqs]
    n = len(reqs)
    return WorkerBatch(mode="extend", reqs=reqs, input_ids=[t for r in reqs for t in r.origin_input_ids],
                       out_cache_loc=torch.cat(locs), prefix_lens=[0] * n,
                       extend_lens=[len(r.origin_input_ids) for r in reqs], sample=[True] * n,
                       input_logprob_ranges=[(0, 0)] * n, input_logprob_targets=[[]] * n)


def decode_batch(runner, reqs: list[Req], tokens: list[int] | None = None,
                 source: WorkerBatch | None = None) -> WorkerBatch:
    """One decode step of reqs whose KV so far is prompt + output_ids (+ the pending token).

    With `source` (the batch launched before, holding every req), the newest token is a
    placeholder naming the req's row there, as the overlap scheduler builds it; otherwise
    `tokens` are the newest tokens, given explicitly."""
    rows = {id(r): i for i, r in enumerate(source.reqs)} if source is not None else {}
    ids, snaps, locs, prefix = [], [], [], []
    for j, r in enumerate(reqs):
        pos = len(r.origin_input_ids) + len(r.output_ids)
        tok = placeholder(rows[id(r)]) if source is not None else tokens[j]
        ids.append(tok)
        snaps.append(r.output_ids + [tok])
        locs.append(_place(runner, r, pos, 1))
        prefix.append(pos)
    n = len(reqs)
    return WorkerBatch(mode="decode", reqs=reqs, input_ids=ids, out_cache_loc=torch.cat(locs), prefix_lens=prefix,
                       extend_lens=[1] * n, sample=[True] * n, input_logprob_ranges=[(0, 0)] * n,
                       input_logprob_targets=[[]] * n,
                       placeholder_source=id(source) if source is not None else None, output_snapshots=snaps)
