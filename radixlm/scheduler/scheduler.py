"""The scheduler: a thin loop over admission, decode, retraction and result processing.

One iteration (`step`): apply received messages (aborts take effect only here, never in
the middle of an iteration) → choose a batch (prefill first, else decode) → run it →
process its result → send outputs.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from radixlm.config import ServerArgs
from radixlm.core import FinishReason, Req, ReqStatus
from radixlm.messages import (AbortReq, BatchTokenOut, CheckIntegrityReq, FlushCacheReq, GetInfoReq, ReqOutput,
                              TokenizedGenerateReq)
from radixlm.scheduler.abort import abort_matches
from radixlm.scheduler.batch import BatchResult, ModelRunnerProtocol, WorkerBatch
from radixlm.scheduler.cache_manager import CacheManager
from radixlm.scheduler.output import StopStringChecker, append_token, make_output
from radixlm.scheduler.policy import make_policy
from radixlm.scheduler.prefill import AddStatus, PrefillAdder
from radixlm.scheduler.retract import RETRACT_DECODE_STEPS, NewTokenRatioTracker, retraction_order

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, args: ServerArgs, runner: ModelRunnerProtocol, cache: CacheManager,
                 *, max_running_requests: int, chunked_prefill_size: int | None,
                 tokenizer=None, send_output: Callable[[BatchTokenOut], None] | None = None,
                 retraction_policy: str = "length") -> None:
        self.args = args
        self.runner = runner
        self.cache = cache
        self.max_running = max_running_requests
        self.chunked_prefill_size = chunked_prefill_size
        self.policy = make_policy(args.schedule_policy, cache, args.random_seed)
        self.ratio = NewTokenRatioTracker(args.schedule_conservativeness)
        self.stop_checker = StopStringChecker(tokenizer)
        self.send_output = send_output or (lambda out: None)
        self.retraction_policy = retraction_policy

        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked_req: Req | None = None
        self._pending_out: list[ReqOutput] = []
        self.stats = {"num_retractions": 0, "num_prefill_tokens": 0, "num_decode_tokens": 0,
                      "num_cached_tokens": 0, "num_steps": 0, "num_aborted": 0, "num_finished": 0}

    # ================================================================ messages
    def handle(self, msg) -> object:
        if isinstance(msg, TokenizedGenerateReq):
            return self.add_request(msg)
        if isinstance(msg, AbortReq):
            return self.abort(msg)
        if isinstance(msg, FlushCacheReq):
            return self.flush_cache()
        if isinstance(msg, GetInfoReq):
            return self.get_info()
        if isinstance(msg, CheckIntegrityReq):
            self.check_integrity()
            return True
        raise TypeError(f"unknown message {type(msg).__name__}")

    def add_request(self, msg: TokenizedGenerateReq) -> None:
        req = Req(rid=msg.rid, origin_input_ids=list(msg.input_ids), sampling_params=msg.sampling_params,
                  eos_token_ids=frozenset(getattr(self.runner, "eos_token_ids", ())),
                  return_logprob=msg.return_logprob, top_logprobs_num=msg.top_logprobs_num,
                  logprob_start_len=msg.logprob_start_len, extra_key=msg.extra_key,
                  priority=msg.priority, stream=msg.stream)
        error = self._validate(req)
        if error is not None:
            req.finish_reason = FinishReason.abort(error, status_code=400)
            self._emit(req)
            return
        self.waiting.append(req)

    def _validate(self, req: Req) -> str | None:
        n = len(req.origin_input_ids)
        limit = min(self.runner.max_context_len, self.cache.capacity) - 1
        if n == 0:
            return "the prompt is empty"
        if n > limit:
            return f"the prompt has {n} tokens, more than the maximum of {limit}"
        if any(not 0 <= t < self.runner.vocab_size for t in req.origin_input_ids):
            return f"input token ids must be in [0, {self.runner.vocab_size})"
        sp = req.sampling_params
        # Generation may not run past the context window.
        sp.max_new_tokens = min(sp.max_new_tokens, self.runner.max_context_len - n)
        sp.min_new_tokens = min(sp.min_new_tokens, sp.max_new_tokens)
        return None

    def abort(self, msg: AbortReq) -> int:
        """Abort matching requests that are not inside a launched batch (the normal loop has
        none between iterations). Returns how many were aborted."""
        count = 0
        for req in [r for r in self.waiting if abort_matches(msg, r.rid)]:
            self.waiting.remove(req)
            self._finish(req, FinishReason.abort(), insert=True)
            count += 1
        if self.chunked_req is not None and abort_matches(msg, self.chunked_req.rid):
            # Chunks already computed are in the tree; the next chunk is never scheduled.
            req, self.chunked_req = self.chunked_req, None
            self._finish(req, FinishReason.abort(), insert=True)
            count += 1
        for req in [r for r in self.running if abort_matches(msg, r.rid)]:
            self.running.remove(req)
            self._finish(req, FinishReason.abort(), insert=True)
            count += 1
        self.stats["num_aborted"] += count
        self._flush_outputs()
        return count

    def flush_cache(self) -> bool:
        if not self.is_idle():
            logger.warning("cache not flushed: requests are still pending")
            return False
        self.cache.flush()
        return True

    # ================================================================ the loop
    def is_idle(self) -> bool:
        return not self.waiting and not self.running and self.chunked_req is None

    def live_reqs(self) -> list[Req]:
        reqs = list(self.running)
        if self.chunked_req is not None:
            reqs.append(self.chunked_req)
        return reqs

    def step(self) -> bool:
        """One iteration. Returns False when there was nothing to do."""
        batch = self.get_next_batch()
        if batch is None:
            self.ratio.on_idle()
            self._flush_outputs()
            return False
        result = self.runner.forward(batch)
        if batch.is_decode:
            self.process_decode_result(batch, result)
        else:
            self.process_prefill_result(batch, result)
        self.stats["num_steps"] += 1
        if self.args.debug_check_integrity:
            self.check_integrity()
        self._flush_outputs()
        return True

    def run_until_idle(self) -> None:
        while self.step():
            pass

    def check_integrity(self) -> None:
        self.cache.check_integrity(self.live_reqs())

    # ================================================================ batch choice
    def get_next_batch(self) -> WorkerBatch | None:
        batch = self.get_prefill_batch()
        if batch is not None:
            return batch
        if self.running:
            return self.get_decode_batch()
        return None

    def get_prefill_batch(self) -> WorkerBatch | None:
        if not self.waiting and self.chunked_req is None:
            return None
        adder = PrefillAdder(self.cache, self.running, self.ratio.value, self.args.max_prefill_tokens,
                             self.chunked_prefill_size, self.max_running, self.args.page_size)
        status = AddStatus.CONTINUE
        if self.chunked_req is not None:
            status = adder.add_chunked_req(self.chunked_req)
        if status is AddStatus.CONTINUE:
            for req in self.policy.order(self.waiting):
                status, _ = adder.add_one_req(req)
                if status is not AddStatus.CONTINUE or adder.plan.new_chunked_req is not None:
                    break
        plan = adder.plan
        if not plan.reqs:
            return None
        if self.chunked_req is not None and self.chunked_req in plan.reqs:
            self.chunked_req = None  # back in process_prefill_result if a chunk remains
        admitted = {id(r) for r in plan.reqs}
        self.waiting = [r for r in self.waiting if id(r) not in admitted]
        input_ids: list[int] = []
        ranges, targets = [], []
        for req, prefix, extend in zip(plan.reqs, plan.prefix_lens, plan.extend_lens):
            fill = req.fill_ids
            input_ids.extend(fill[prefix:prefix + extend])
            r, t = self._input_logprob_range(req, prefix, extend)
            ranges.append(r)
            targets.append(t)
            self.stats["num_prefill_tokens"] += extend
            self.stats["num_cached_tokens"] += prefix if prefix == req.prefix_len else 0
        return WorkerBatch(mode="extend", reqs=plan.reqs, input_ids=input_ids,
                           out_cache_loc=torch.cat(plan.out_locs), prefix_lens=plan.prefix_lens,
                           extend_lens=plan.extend_lens, sample=plan.sample,
                           input_logprob_ranges=ranges, input_logprob_targets=targets)

    @staticmethod
    def _input_logprob_range(req: Req, prefix: int, extend: int) -> tuple[tuple[int, int], list[int]]:
        """Extend indices whose next-token logprobs are prompt logprobs for this request."""
        n_prompt = len(req.origin_input_ids)
        if not req.return_logprob or req.logprob_start_len < 0 or req.output_ids:
            return (0, 0), []
        # Position p's hidden state predicts token p + 1; prompt tokens from start need it.
        lo = max(req.logprob_start_len - 1, prefix) - prefix
        hi = min(n_prompt - 1, prefix + extend) - prefix
        if hi <= lo:
            return (0, 0), []
        return (lo, hi), req.origin_input_ids[prefix + lo + 1: prefix + hi + 1]

    def get_decode_batch(self) -> WorkerBatch | None:
        self._ensure_decode_memory()
        if not self.running:
            return None
        locs = []
        for req in self.running:
            loc = self.cache.extend(req, 1)
            assert loc is not None, "decode memory was checked"
            locs.append(loc)
        reqs = list(self.running)
        self.ratio.on_decode_step()
        self.stats["num_decode_tokens"] += len(reqs)
        return WorkerBatch(mode="decode", reqs=reqs, input_ids=[r.output_ids[-1] for r in reqs],
                           out_cache_loc=torch.cat(locs), prefix_lens=[r.kv_committed_len for r in reqs],
                           extend_lens=[1] * len(reqs), sample=[True] * len(reqs),
                           input_logprob_ranges=[(0, 0)] * len(reqs), input_logprob_targets=[[]] * len(reqs))

    # ================================================================ retraction
    def _decode_fits(self, num_reqs: int, steps: int) -> bool:
        need = num_reqs * steps * self.args.page_size
        short = need - self.cache.available()
        if short > 0:
            self.cache.evicted_tokens_total += self.cache.tree.evict(short)
        return self.cache.available() >= need

    def _ensure_decode_memory(self) -> None:
        if self._decode_fits(len(self.running), 1):
            return
        order = retraction_order(self.running, self.retraction_policy)
        retracted = 0
        while len(order) > 1 and not self._decode_fits(len(order), RETRACT_DECODE_STEPS):
            victim = order.pop()
            self.cache.release(victim, insert=True)
            victim.reset_for_retract()
            self.waiting.append(victim)
            retracted += 1
        self.running = [r for r in self.running if r in order]
        if retracted:
            self.stats["num_retractions"] += retracted
            self.ratio.on_retract(self.running)
            logger.info("retracted %d request(s); new_token_ratio -> %.3f", retracted, self.ratio.value)
        if not self._decode_fits(len(self.running), 1):
            # A single request that cannot get one more slot: answer it instead of crashing.
            for req in list(self.running):
                self.running.remove(req)
                self._finish(req, FinishReason.abort("out of memory: the KV cache cannot hold this "
                                                     "request", status_code=500), insert=True)

    # ================================================================ results
    def process_prefill_result(self, batch: WorkerBatch, result: BatchResult) -> None:
        for i, req in enumerate(batch.reqs):
            self.cache.commit(req, batch.extend_lens[i])
            if result.input_logprobs[i] is not None:
                self._record_input_logprobs(req, batch, i, result)
            if not batch.sample[i]:
                self.cache.cache_prefill(req)
                req.status = ReqStatus.CHUNKED
                self.chunked_req = req
                continue
            req.is_chunked = 0
            if req.sampling_params.max_new_tokens == 0:
                req.finish_reason = FinishReason("length", length=0)
            else:
                self._accept_token(req, result, i)
            if req.finished:
                self._finish(req, req.finish_reason, insert=True)
            else:
                self.cache.cache_prefill(req)
                req.status = ReqStatus.RUNNING
                self.running.append(req)
                self._maybe_stream(req)

    def process_decode_result(self, batch: WorkerBatch, result: BatchResult) -> None:
        finished = []
        for i, req in enumerate(batch.reqs):
            self.cache.commit(req, 1)
            self._accept_token(req, result, i)
            if req.finished:
                finished.append(req)
            else:
                self._maybe_stream(req)
        if finished:
            done = {id(r) for r in finished}
            self.running = [r for r in self.running if id(r) not in done]
            for req in finished:
                self._finish(req, req.finish_reason, insert=True)

    def _accept_token(self, req: Req, result: BatchResult, i: int) -> None:
        if req.to_finish is not None:
            req.check_finished()  # consumes the pending abort; the sampled token is dropped
            return
        if req.first_token_time is None:
            req.first_token_time = time.perf_counter()
        append_token(req, result.next_token_ids[i], result.logprobs[i], result.top_logprobs[i])
        req.check_finished()
        self.stop_checker.check(req)

    def _record_input_logprobs(self, req: Req, batch: WorkerBatch, i: int, result: BatchResult) -> None:
        if not req.input_token_logprobs and req.logprob_start_len == 0:
            req.input_token_logprobs.append((None, req.origin_input_ids[0]))
            if req.top_logprobs_num > 0:
                req.input_top_logprobs.append(None)
        targets = batch.input_logprob_targets[i]
        for j, (lp, tok) in enumerate(zip(result.input_logprobs[i], targets)):
            req.input_token_logprobs.append((lp, tok))
            if req.top_logprobs_num > 0:
                req.input_top_logprobs.append(result.input_top_logprobs[i][j])

    def _finish(self, req: Req, reason: FinishReason, insert: bool) -> None:
        """Terminal state: the request's one exit for KV and its one final output."""
        req.finish_reason = reason
        req.to_finish = None
        req.status = ReqStatus.FINISHED
        req.finished_time = time.perf_counter()
        self.cache.release(req, insert=insert)
        self.stats["num_finished"] += 1
        self._emit(req)

    def _maybe_stream(self, req: Req) -> None:
        if req.stream and len(req.output_ids) - req.sent_len >= self.args.stream_interval:
            self._emit(req)

    def _emit(self, req: Req) -> None:
        self._pending_out.append(make_output(req, include_input_logprobs=req.sent_len == 0))

    def _flush_outputs(self) -> None:
        if self._pending_out:
            out, self._pending_out = self._pending_out, []
            self.send_output(BatchTokenOut(out))

    # ================================================================ info
    def get_info(self) -> dict:
        return {"memory": self.cache.memory_stats(), "num_running_reqs": len(self.running),
                "num_waiting_reqs": len(self.waiting) + (1 if self.chunked_req else 0),
                "new_token_ratio": self.ratio.value, "evicted_tokens_total": self.cache.evicted_tokens_total,
                **self.stats, **(self.runner.info() if hasattr(self.runner, "info") else {})}
