"""A model runner stand-in whose 'KV' records which token sits in each slot.

Every forward checks that the KV a request reads (its row of the request-to-token table)
holds exactly that request's tokens, so any stale or foreign KV reuse fails loudly. The next
token is a deterministic function of the whole sequence, so outputs can be compared
across scheduling configurations.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from radixlm.scheduler.batch import BatchResult, LaunchedForward, WorkerBatch
from radixlm.scheduler.overlap import fill_snapshots, resolve_placeholders
from radixlm.speculative.acceptance import Verified

EMPTY = -1


class FakeRunner:
    def __init__(self, capacity: int, req_to_token_pool, vocab_size: int = 97,
                 max_context_len: int = 512, eos_token_ids: tuple[int, ...] = (),
                 memory: int | None = None) -> None:
        self.vocab_size = vocab_size
        # The next token depends on the last `memory` tokens (None: the whole sequence): a
        # short memory makes the text repeat, so n-gram drafts get accepted.
        self.memory = memory
        self.max_context_len = max_context_len
        self.eos_token_ids = eos_token_ids
        self.req_to_token = req_to_token_pool.req_to_token
        self.kv = torch.full((capacity + 1,), EMPTY, dtype=torch.int64)
        self.forward_calls: list[WorkerBatch] = []
        self.tokens_computed = 0
        # Fault injection (error-boundary tests): called with every batch; raising fails it,
        # in the forward (fail_forward) or when its result is read (fail_result).
        self.fail_forward: Callable[[WorkerBatch], None] | None = None
        self.fail_result: Callable[[WorkerBatch], None] | None = None

    # ---- the rest of ModelRunnerProtocol: a fake model has no weights and no device memory ----
    def info(self) -> dict:
        return {}

    def update_weights_from_tensor(self, named_tensors) -> int:
        raise NotImplementedError("the fake model has no weights")

    def update_weights_from_disk(self, model_path: str) -> int:
        raise NotImplementedError("the fake model has no weights")

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        raise NotImplementedError("the fake model has no weights")

    def release_memory(self) -> None:
        self.kv.fill_(EMPTY)  # what a released pool holds afterwards: nothing

    def resume_memory(self) -> None:
        pass

    def next_of(self, seq: list[int]) -> int:
        return self.next_token(seq if self.memory is None else seq[-self.memory:], self.vocab_size)

    @staticmethod
    def next_token(seq: list[int], vocab: int) -> int:
        h = 0
        for t in seq:
            h = (h * 31 + t + 7) % 1_000_003
        return h % vocab

    def launch(self, batch: WorkerBatch, prev: LaunchedForward | None = None) -> "DoneForward":
        """Computes at once, on the host: placeholders are resolved from prev's result."""
        start = time.perf_counter()
        if batch.placeholder_source is not None:
            assert prev is not None and id(prev.batch) == batch.placeholder_source
            batch.input_ids = resolve_placeholders(torch.tensor(batch.input_ids), prev.tokens).tolist()
            fill_snapshots(batch, prev.result().next_token_ids)
        result = self.forward(batch)
        ids = torch.tensor([-1 if t is None else t for t in result.next_token_ids], dtype=torch.int64)
        return DoneForward(batch, ids, result, start, time.perf_counter(), self.fail_result)

    def forward(self, batch: WorkerBatch) -> BatchResult:
        assert batch.placeholder_source is None or min(batch.input_ids) >= 0, "unresolved placeholder"
        if self.fail_forward is not None:
            self.fail_forward(batch)
        self.forward_calls.append(batch)
        pos = 0
        n = len(batch.reqs)
        next_ids: list[int | None] = [None] * n
        grammar_status: list[str | None] = [None] * n
        verified: list[Verified | None] = [None] * n
        for i, req in enumerate(batch.reqs):
            prefix, extend = batch.prefix_lens[i], batch.extend_lens[i]
            # a launched batch must not read live request state the scheduler is mutating
            out = batch.output_snapshots[i] if batch.output_snapshots is not None else req.output_ids
            draft = batch.drafts[i] if batch.drafts is not None else []
            fill = req.origin_input_ids + out + draft
            row = self.req_to_token[req.req_pool_idx]
            # the prefix must already hold this request's own tokens
            held = self.kv[row[:prefix]].tolist()
            assert held == fill[:prefix], f"{req.rid}: stale KV in prefix: {held[:8]} vs {fill[:8]}"
            locs = batch.out_cache_loc[pos:pos + extend]
            assert row[prefix:prefix + extend].tolist() == locs.tolist(), "row does not match out_cache_loc"
            assert batch.input_ids[pos:pos + extend] == fill[prefix:prefix + extend]
            self.kv[locs] = torch.tensor(fill[prefix:prefix + extend], dtype=torch.int64)
            pos += extend
            self.tokens_computed += extend
            if draft:
                matcher = batch.grammars[i] if batch.grammars is not None else None
                targets = [self.next_of(fill[:prefix + 1 + j]) for j in range(len(draft) + 1)]
                if matcher is not None:  # the drafts obey the grammar (the scheduler cut them)
                    targets = [matcher.constrain(t, self.vocab_size) for t in targets]
                n_ok = 0
                while n_ok < len(draft) and targets[n_ok] == draft[n_ok]:
                    n_ok += 1
                next_ids[i] = targets[0]
                if matcher is not None:
                    batch.grammars_advanced = True
                    ok = all(matcher.accept(t) for t in targets[:n_ok + 1])
                    grammar_status[i] = "rejected" if not ok else "terminated" if matcher.terminated else None
                emitted = targets[:n_ok + 1]
                verified[i] = Verified(emitted, len(draft), [-1.0 if req.return_logprob else None] * len(emitted),
                                       [[(-1.0, t)] if req.top_logprobs_num else None for t in emitted])
            elif batch.sample[i]:
                next_ids[i] = self.next_of(fill[:prefix + extend])
                matcher = batch.grammars[i] if batch.grammars is not None else None
                if matcher is not None and not matcher.terminated:
                    # like the real runner: constrain, then advance the matcher at once
                    next_ids[i] = matcher.constrain(next_ids[i], self.vocab_size)
                    batch.grammars_advanced = True
                    ok = matcher.accept(next_ids[i])
                    grammar_status[i] = "rejected" if not ok else "terminated" if matcher.terminated else None
        logprobs = [-1.0 if r.return_logprob else None for r in batch.reqs]
        tops = [[(-1.0, t)] if t is not None and r.top_logprobs_num else None
                for r, t in zip(batch.reqs, next_ids)]
        in_lps = [[-2.0] * (hi - lo) if hi > lo else None for lo, hi in batch.input_logprob_ranges]
        in_tops = [[[(-2.0, 0)]] * (hi - lo) if hi > lo else None for lo, hi in batch.input_logprob_ranges]
        if batch.drafts is not None:
            for i, req in enumerate(batch.reqs):
                if verified[i] is None:
                    verified[i] = Verified([next_ids[i]], 0, [logprobs[i]], [tops[i]])  # type: ignore[list-item]
        return BatchResult(next_ids, logprobs, tops, in_lps, in_tops,
                           grammar_status if batch.grammars is not None else None,
                           verified if batch.drafts is not None else None)


@dataclass
class DoneForward:
    batch: WorkerBatch
    tokens: torch.Tensor
    _result: BatchResult
    start: float
    end: float
    fail: Callable[[WorkerBatch], None] | None = None

    def result(self) -> BatchResult:
        if self.fail is not None:
            self.fail(self.batch)
        return self._result

    def span(self) -> tuple[float, float]:
        return self.start, self.end


def reference_output(prompt: list[int], max_new: int, vocab: int = 97, memory: int | None = None) -> list[int]:
    seq = list(prompt)
    out = []
    for _ in range(max_new):
        t = FakeRunner.next_token(seq if memory is None else seq[-memory:], vocab)
        out.append(t)
        seq.append(t)
    return out
