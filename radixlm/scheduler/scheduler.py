"""The scheduler: a thin loop over admission, decode, retraction and result processing.

One iteration (`step`): apply received messages (aborts take effect only here, never in
the middle of an iteration) → choose a batch (prefill first, else decode) → run it →
process its result → send outputs.
"""
from __future__ import annotations

import collections
import logging
import time
from typing import Callable

import torch

from radixlm.config import ServerArgs
from radixlm.core import FinishReason, Req, ReqStatus
from radixlm.messages import (AbortReq, BatchTokenOut, CheckIntegrityReq, ContinueReq, DestroyWeightsUpdateGroupReq,
                              FlushCacheReq, GetInfoReq, GetWeightsByNameReq, InitWeightsUpdateGroupReq, PauseReq,
                              ReleaseMemoryReq, ReqOutput, ResumeMemoryReq, TokenizedGenerateReq,
                              UpdateWeightsFromDiskReq, UpdateWeightsFromDistributedReq, UpdateWeightsFromTensorReq)
from radixlm.rank_sync import LOCAL_RANK, RankSync
from radixlm.scheduler.abort import abort_matches
from radixlm.scheduler.batch import BatchResult, ModelRunnerProtocol, WorkerBatch
from radixlm.scheduler.cache_manager import CacheManager
from radixlm.scheduler.error_boundary import ErrorBoundary
from radixlm.scheduler.grammar_queue import GrammarBackend, GrammarQueue, grammar_finish
from radixlm.scheduler.output import StopStringChecker, append_token, make_output
from radixlm.scheduler.overlap import ForwardTimer, ForwardWorker, InFlight, placeholder
from radixlm.scheduler.policy import make_policy
from radixlm.scheduler.prefill import AddStatus, PrefillAdder
from radixlm.scheduler.retract import RETRACT_DECODE_STEPS, NewTokenRatioTracker, retraction_order

logger = logging.getLogger(__name__)

# Upper bounds (seconds) of the cancel-latency histogram: abort call -> KV returned.
CANCEL_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, float("inf"))


class Scheduler:
    def __init__(self, args: ServerArgs, runner: ModelRunnerProtocol, cache: CacheManager,
                 *, max_running_requests: int, chunked_prefill_size: int | None,
                 tokenizer=None, send_output: Callable[[BatchTokenOut], None] | None = None,
                 grammar_backend: GrammarBackend | None = None) -> None:
        self.args = args
        self.runner = runner
        self.cache = cache
        self.max_running = max_running_requests
        self.chunked_prefill_size = chunked_prefill_size
        self.policy = make_policy(args.schedule_policy, cache, args.random_seed)
        self.ratio = NewTokenRatioTracker(args.schedule_conservativeness)
        self.stop_checker = StopStringChecker(tokenizer)
        self.send_output = send_output or (lambda out: None)
        self.retraction_policy = args.retraction_policy
        # The clock of timeouts and queue order; tensor-parallel ranks share rank 0's (rank_sync.py).
        self.ranks: RankSync = LOCAL_RANK

        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked_req: Req | None = None
        # structured-output requests waiting for their grammar to compile (semantics §1)
        self.grammar_queue = GrammarQueue(grammar_backend)
        self.overlap = args.overlap_schedule(getattr(runner, "device", "cpu"))
        self.worker = ForwardWorker(runner) if self.overlap else None
        self.timer = self.worker.timer if self.worker else ForwardTimer()
        self.in_flight: InFlight | None = None
        # finished requests whose KV a launched batch may still write: released after it
        self.pending_release: dict[int, Req] = {}
        self._pending_out: list[ReqOutput] = []
        self.paused = False
        self.stats = {"num_retractions": 0, "num_prefill_tokens": 0, "num_decode_tokens": 0,
                      "num_cached_tokens": 0, "num_steps": 0, "num_aborted": 0, "num_finished": 0,
                      "aborts_waiting": 0, "aborts_chunked": 0, "aborts_running": 0,
                      "aborts_in_flight": 0, "aborts_grammar": 0, "num_timeouts": 0, "num_rejected": 0}
        # abort call -> KV returned, seconds (bounded window for percentiles)
        self.cancel_latencies: collections.deque[float] = collections.deque(maxlen=4096)
        # (rid, abort call, KV returned) wall times of the latest cancels (latency benchmarks)
        self.recent_cancels: collections.deque[tuple[str, float, float]] = collections.deque(maxlen=256)
        # cumulative histogram of the same, for Prometheus
        self.cancel_hist = {"buckets": list(CANCEL_LATENCY_BUCKETS), "counts": [0] * len(CANCEL_LATENCY_BUCKETS),
                            "sum": 0.0, "count": 0}
        self.boundary = ErrorBoundary(self)  # one request's failure ends that request only

    # ================================================================ messages
    def handle(self, msg) -> object:
        if isinstance(msg, TokenizedGenerateReq):
            try:
                return self.add_request(msg)
            except Exception as e:  # noqa: BLE001 - answered, not dropped
                return self.boundary.reject(msg, e)
        if isinstance(msg, AbortReq):
            return self.abort(msg)
        if isinstance(msg, FlushCacheReq):
            return self.flush_cache()
        if isinstance(msg, GetInfoReq):
            return self.get_info()
        if isinstance(msg, CheckIntegrityReq):
            self.check_integrity()
            return True
        if isinstance(msg, PauseReq):
            return self.pause(msg.mode)
        if isinstance(msg, ContinueReq):
            return self.resume()
        if isinstance(msg, UpdateWeightsFromTensorReq):
            return self._weights_op(lambda: self.runner.update_weights_from_tensor(msg.named_tensors),
                                    msg.flush_cache, msg.cache_namespace)
        if isinstance(msg, UpdateWeightsFromDiskReq):
            return self._weights_op(lambda: self.runner.update_weights_from_disk(msg.model_path),
                                    msg.flush_cache, msg.cache_namespace)
        if isinstance(msg, UpdateWeightsFromDistributedReq):
            return self._weights_op(lambda: self.runner.update_weights_from_distributed(
                msg.names, msg.dtypes, msg.shapes, msg.group_name), msg.flush_cache, msg.cache_namespace)
        if isinstance(msg, InitWeightsUpdateGroupReq):
            return self.runner.init_weights_update_group(msg.master_address, msg.master_port, msg.rank_offset,
                                                         msg.world_size, msg.group_name, msg.backend)
        if isinstance(msg, DestroyWeightsUpdateGroupReq):
            return self.runner.destroy_weights_update_group(msg.group_name)
        if isinstance(msg, GetWeightsByNameReq):
            self.sync()
            return self.runner.get_weights_by_name(msg.name, msg.truncate_size, msg.max_elements)
        if isinstance(msg, ReleaseMemoryReq):
            return self._memory_op(release=True)
        if isinstance(msg, ResumeMemoryReq):
            return self._memory_op(release=False)
        raise TypeError(f"unknown message {type(msg).__name__}")

    def add_request(self, msg: TokenizedGenerateReq) -> None:
        req = Req(rid=msg.rid, origin_input_ids=list(msg.input_ids), sampling_params=msg.sampling_params,
                  eos_token_ids=frozenset(getattr(self.runner, "eos_token_ids", ())),
                  return_logprob=msg.return_logprob, top_logprobs_num=msg.top_logprobs_num,
                  logprob_start_len=msg.logprob_start_len, extra_key=msg.extra_key,
                  priority=msg.priority, stream=msg.stream, timeout=msg.timeout, created_time=self.ranks.now())
        error = self._validate(req)
        if error is not None:
            req.finish_reason = FinishReason.abort(error, status_code=400)
            self._emit(req)
            self._flush_outputs()
            return
        limit = self.args.max_queued_requests
        if limit is not None and len(self.waiting) + len(self.grammar_queue) >= limit:
            req.finish_reason = FinishReason.abort(f"the queue is full ({limit} waiting requests)",
                                                   status_code=503)
            self.stats["num_rejected"] += 1
            self._emit(req)
            self._flush_outputs()
            return
        grammar = req.sampling_params.grammar
        if grammar is not None:
            self.grammar_queue.add(req, grammar)  # _validate made sure there is one
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
        if sp.grammar is not None and not self.grammar_queue.available:
            return "structured output (json_schema, regex, ebnf) is not available: xgrammar is not installed"
        # Generation may not run past the context window.
        sp.max_new_tokens = min(sp.max_new_tokens, self.runner.max_context_len - n)
        sp.min_new_tokens = min(sp.min_new_tokens, sp.max_new_tokens)
        return None

    def in_flight_reqs(self) -> set[int]:
        """ids of requests inside a launched batch whose result is not processed yet (only the
        overlap loop has one between iterations)."""
        return {id(r) for r in self.in_flight.batch.reqs} if self.in_flight is not None else set()

    def abort(self, msg: AbortReq) -> int:
        """Apply an abort at the top of an iteration; returns how many requests it hit."""
        if msg.rids and not isinstance(msg.rids, set):
            msg.rids = set(msg.rids)  # type: ignore[assignment]
        reason = FinishReason.abort()
        in_flight = self.in_flight_reqs()
        count = 0
        # method 1: not admitted (waiting, or retracted and waiting to resume)
        for req in [r for r in self.waiting if abort_matches(msg, r.rid)]:
            self.waiting.remove(req)
            req.abort_sent_time = msg.sent_time or None
            self._finish(req, reason, insert=True)
            self.stats["aborts_waiting"] += 1
            count += 1
        # method 2: waiting for a grammar compile: cancel it, answer at once (no KV held)
        for req in [r for r in self.grammar_queue.reqs if abort_matches(msg, r.rid)]:
            self.grammar_queue.remove(req)
            req.abort_sent_time = msg.sent_time or None
            self._finish(req, reason, insert=True)
            self.stats["aborts_grammar"] += 1
            count += 1
        # chunked prefill: computed chunks stay in the tree, the next chunk never runs
        req = self.chunked_req
        if req is not None and abort_matches(msg, req.rid):
            req.abort_sent_time = msg.sent_time or None
            if id(req) in in_flight:
                req.to_finish = reason
                self.stats["aborts_in_flight"] += 1
            else:
                self.chunked_req = None
                self._finish(req, reason, insert=True)
                self.stats["aborts_chunked"] += 1
            count += 1
        # in a launched prefill batch (not yet back in running or chunked): consumed at processing
        if self.in_flight is not None and not self.in_flight.batch.is_decode:
            for req in self.in_flight.batch.reqs:
                if req.to_finish is None and not req.finished and abort_matches(msg, req.rid) \
                        and req is not self.chunked_req:
                    req.abort_sent_time = msg.sent_time or None
                    req.to_finish = reason
                    self.stats["aborts_in_flight"] += 1
                    count += 1
        # method 3: running; inside a launched batch the next result processing consumes it
        for req in [r for r in self.running if abort_matches(msg, r.rid) and r.to_finish is None]:
            req.abort_sent_time = msg.sent_time or None
            if id(req) in in_flight:
                req.to_finish = reason
                self.stats["aborts_in_flight"] += 1
            else:
                self.running.remove(req)
                self._finish(req, reason, insert=True)
                self.stats["aborts_running"] += 1
            count += 1
        self.stats["num_aborted"] += count
        self._flush_outputs()
        return count

    def check_timeouts(self) -> None:
        """Per-request deadlines and the server-wide waiting/running limits (503)."""
        now = self.ranks.now()
        wait_limit, run_limit = self.args.request_waiting_timeout, self.args.request_running_timeout

        def expired(req: Req, waiting: bool) -> str | None:
            if req.timeout is not None and now - req.created_time > req.timeout:
                return f"request timed out after {req.timeout:g} s"
            if waiting and wait_limit is not None and now - req.created_time > wait_limit:
                return f"request waited longer than {wait_limit:g} s in the queue"
            if not waiting and run_limit is not None and req.admit_time is not None \
                    and now - req.admit_time > run_limit:
                return f"request ran longer than {run_limit:g} s"
            return None

        for req in list(self.waiting):
            why = expired(req, waiting=True)
            if why:
                self.waiting.remove(req)
                self._finish(req, FinishReason.abort(why, status_code=503), insert=True)
                self.stats["num_timeouts"] += 1
        for req in self.grammar_queue.reqs:
            why = expired(req, waiting=True)
            if why:
                self.grammar_queue.remove(req)
                self._finish(req, FinishReason.abort(why, status_code=503), insert=True)
                self.stats["num_timeouts"] += 1
        in_flight = self.in_flight_reqs()
        live = self.running + ([self.chunked_req] if self.chunked_req is not None else [])
        for req in live:
            why = req.to_finish is None and expired(req, waiting=False)
            if not why:
                continue
            self.stats["num_timeouts"] += 1
            reason = FinishReason.abort(why, status_code=503)
            if id(req) in in_flight:
                req.to_finish = reason
            elif req is self.chunked_req:
                self.chunked_req = None
                self._finish(req, reason, insert=True)
            else:
                self.running.remove(req)
                self._finish(req, reason, insert=True)

    def pause(self, mode: str) -> bool:
        """Stop scheduling. abort: answer everything; retract: running requests go back to
        waiting and their KV to the tree; in_place: keep requests and KV as they are."""
        if mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"unknown pause mode {mode!r}")
        self.sync()
        self.paused = True
        if mode == "abort":
            self.abort(AbortReq(abort_all=True))
        elif mode == "retract":
            for req in list(self.running):
                self._retract(req)
            self.running = []
            if self.chunked_req is not None:
                self._retract(self.chunked_req)
                self.chunked_req = None
            self._flush_outputs()
        return True

    def resume(self) -> bool:
        self.paused = False
        return True

    def _weights_op(self, op, flush: bool, namespace: str | None = None) -> dict:
        """Weights change only between forwards: the launched batch resolves first. The
        cache is namespaced by weight version, so old KV is never served afterwards."""
        self.sync()
        n = op()
        live = self._move_to_new_weights(namespace) if namespace is not None else {}
        return {"num_tensors": n, "flushed": self.flush_cache() if flush else False, "live_output_lens": live}

    def _move_to_new_weights(self, namespace: str) -> dict[str, int]:
        """Requests are here during an update only if the engine is paused (the front end's
        lock waits for all others). One with no KV of its own (waiting, retracted, grammar)
        computes everything under the new weights, so it moves to the new cache namespace;
        a chunked prefill is retracted first (its chunks are old-weights KV, and it has no
        token yet); a running (in_place) request keeps its KV and continues on it. Returns
        each live request's output length at the switch (meta_info["weight_versions"])."""
        if self.chunked_req is not None:
            self._retract(self.chunked_req)
            self.chunked_req = None
        for req in self.waiting + self.grammar_queue.reqs:
            req.extra_key = namespace
        return {r.rid: len(r.output_ids) for r in self.running + self.waiting + self.grammar_queue.reqs}

    def _memory_op(self, release: bool) -> bool:
        self.sync()
        if release:
            if not self.is_idle():
                raise RuntimeError("cannot release memory while requests are running; pause or abort them first")
            self.cache.flush()  # the KV pool's contents are about to vanish
            self.runner.release_memory()
        else:
            self.runner.resume_memory()
        return True

    def flush_cache(self) -> bool:
        if not self.is_idle():
            logger.warning("cache not flushed: requests are still pending")
            return False
        self.cache.flush()
        return True

    # ================================================================ the loop
    def is_idle(self) -> bool:
        return (not self.waiting and not self.running and self.chunked_req is None
                and self.in_flight is None and not self.pending_release and not self.grammar_queue)

    def live_reqs(self) -> list[Req]:
        """Every request that holds KV right now."""
        seen: dict[int, Req] = {id(r): r for r in self.running}
        if self.chunked_req is not None:
            seen[id(self.chunked_req)] = self.chunked_req
        if self.in_flight is not None:
            seen.update((id(r), r) for r in self.in_flight.batch.reqs if r.req_pool_idx is not None)
        seen.update(self.pending_release)
        return list(seen.values())

    def step(self) -> bool:
        """One iteration. Returns False when there was nothing to do."""
        self.cache.tree.check_events()  # HiCache: acks of finished host copies unlock their nodes
        self.check_timeouts()
        self._admit_compiled()
        if self.overlap:
            return self._step_overlap()
        batch = None if self.paused else self.get_next_batch()
        if batch is None:
            return self._idle()
        self._mark_launched(batch)
        self._process(batch, self.boundary.run(batch))
        self._end_step()
        return True

    def _step_overlap(self) -> bool:
        """Launch batch N+1, then process batch N while N+1 computes."""
        if self.in_flight is not None and (not self.in_flight.batch.is_decode or self.boundary.must_sync):
            self.sync()  # a prefill's requests join decode only once its result is known
        batch = None if self.paused else self.get_next_batch()
        prev, self.in_flight = self.in_flight, None
        if batch is not None:
            self._mark_launched(batch)
            self.in_flight = self.worker.submit(batch)
        if prev is not None:
            self._process(prev.batch, self.boundary.resolve(prev))
        if batch is None and prev is None:
            return self._idle()
        self._end_step()
        return True

    def _idle(self) -> bool:
        """Nothing to run. Returns False (the caller may block on its inbox) unless a grammar
        is compiling: then wait briefly for it and report progress, so the request moves on
        as soon as its compile is done."""
        self.ratio.on_idle()
        self._flush_outputs()
        if self.grammar_queue:
            self.grammar_queue.wait()
            return True
        return False

    def _admit_compiled(self) -> None:
        """Grammar queue → waiting queue for compiled grammars; failed compiles answered with 400."""
        if not self.grammar_queue:
            return
        ready, failed = self.grammar_queue.pop_ready()
        self.waiting.extend(ready)
        for req, reason in failed:
            self._finish(req, reason, insert=True)

    def sync(self) -> None:
        """Process the launched batch now (pause, flush, retraction and weight updates need
        nothing in flight)."""
        if self.in_flight is not None:
            prev, self.in_flight = self.in_flight, None
            self._process(prev.batch, self.boundary.resolve(prev))
            self._flush_outputs()

    def _end_step(self) -> None:
        self.stats["num_steps"] += 1
        if self.args.debug_check_integrity:
            self.check_integrity()
        self._flush_outputs()

    def _mark_launched(self, batch: WorkerBatch) -> None:
        for req, samples in zip(batch.reqs, batch.sample):
            req.inflight += 1
            if samples:
                req.pending_tokens += 1

    def _process(self, batch: WorkerBatch, result: BatchResult) -> None:
        for req, samples in zip(batch.reqs, batch.sample):
            req.inflight -= 1
            if samples:
                req.pending_tokens -= 1
        if batch.is_decode:
            self.process_decode_result(batch, result)
        else:
            self.process_prefill_result(batch, result)
        for req in batch.reqs:
            if req.inflight == 0 and self.pending_release.pop(id(req), None) is not None:
                self.cache.release(req, insert=True)
                self._on_released(req)

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
                status = self.boundary.admit(adder, req)
                if status is not AddStatus.CONTINUE or adder.plan.new_chunked_req is not None:
                    break
        plan = adder.plan
        if not plan.reqs:
            return None
        if self.chunked_req is not None and self.chunked_req in plan.reqs:
            self.chunked_req = None  # back in process_prefill_result if a chunk remains
        admitted = {id(r) for r in plan.reqs}
        self.waiting = [r for r in self.waiting if id(r) not in admitted]
        now = self.ranks.now()
        for r in plan.reqs:
            if r.admit_time is None:
                r.admit_time = now
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
                           input_logprob_ranges=ranges, input_logprob_targets=targets,
                           grammars=self._grammars(plan.reqs))

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
        candidates = self._decode_candidates()
        if not candidates:
            return None
        if not self._decode_fits(len(candidates), 1):
            self.sync()  # retraction must not touch requests a launched batch still writes
            self._ensure_decode_memory()
        reqs = self._decode_candidates()
        if not reqs:
            return None
        src = self.in_flight.batch if self.in_flight is not None else None
        src_rows = {id(r): i for i, r in enumerate(src.reqs)} if src is not None else {}
        locs, input_ids, prefix_lens, snapshots = [], [], [], []
        for req in reqs:
            position = len(req.fill_ids) + req.pending_tokens - 1
            loc = self.cache.extend(req, 1)
            assert loc is not None, "decode memory was checked"
            assert req.kv_allocated_len == position + 1, "decode slot out of step with the sequence"
            locs.append(loc)
            prefix_lens.append(position)
            # the newest token is still being sampled by the launched batch: name its row
            input_ids.append(placeholder(src_rows[id(req)]) if req.pending_tokens else req.output_ids[-1])
            if self.overlap:
                snapshots.append(req.output_ids + [input_ids[-1]] if req.pending_tokens else list(req.output_ids))
        self.ratio.on_decode_step()
        self.stats["num_decode_tokens"] += len(reqs)
        n = len(reqs)
        return WorkerBatch(mode="decode", reqs=reqs, input_ids=input_ids, out_cache_loc=torch.cat(locs),
                           prefix_lens=prefix_lens, extend_lens=[1] * n, sample=[True] * n,
                           input_logprob_ranges=[(0, 0)] * n, input_logprob_targets=[[]] * n,
                           placeholder_source=id(src) if any(r.pending_tokens for r in reqs) else None,
                           output_snapshots=snapshots if self.overlap else None,
                           grammars=self._grammars(reqs))

    @staticmethod
    def _grammars(reqs: list[Req]) -> list | None:
        return [r.grammar for r in reqs] if any(r.grammar is not None for r in reqs) else None

    def _decode_candidates(self) -> list[Req]:
        """Running requests that need another token: not being aborted, and not certain to
        reach max_new_tokens with the token already in flight."""
        return [r for r in self.running if r.to_finish is None
                and len(r.output_ids) + r.pending_tokens < r.sampling_params.max_new_tokens]

    # ================================================================ retraction
    def _decode_fits(self, num_reqs: int, steps: int) -> bool:
        return self.cache.make_room(num_reqs * steps * self.args.page_size)

    def _ensure_decode_memory(self) -> None:
        if self._decode_fits(len(self.running), 1):
            return
        order = retraction_order(self.running, self.retraction_policy)
        retracted = 0
        while len(order) > 1 and not self._decode_fits(len(order), RETRACT_DECODE_STEPS):
            self._retract(order.pop())
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

    def _retract(self, req: Req) -> None:
        """Back to waiting: computed KV goes to the tree (reused on resume if it survives)."""
        self.cache.release(req, insert=True)
        req.reset_for_retract()
        self.waiting.append(req)

    # ================================================================ results
    def process_prefill_result(self, batch: WorkerBatch, result: BatchResult) -> None:
        for i, req in enumerate(batch.reqs):
            self.cache.commit(req, batch.extend_lens[i])
            if req.to_finish is not None:  # aborted while this batch was in flight
                if self.chunked_req is req:
                    self.chunked_req = None
                self._finish(req, req.to_finish, insert=True)
                continue
            if req.return_logprob and req.logprob_start_len >= 0 and not req.output_ids:
                with self.boundary.guard(req, "recording its prompt logprobs"):
                    self._record_input_logprobs(req, batch, i, result)
                if req.finished:  # that failed: the request ends here
                    self._finish(req, req.finish_reason, insert=True)
                    continue
            if not batch.sample[i]:
                self.cache.cache_prefill(req)
                req.status = ReqStatus.CHUNKED
                self.chunked_req = req
                continue
            req.is_chunked = 0
            if req.sampling_params.max_new_tokens == 0:
                req.finish_reason = FinishReason("length", length=0)
            else:
                with self.boundary.guard(req, "processing its output"):
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
            if req.finished:
                continue  # finished while this batch was in flight: its extra slot is freed on release
            self.cache.commit(req, 1)
            with self.boundary.guard(req, "processing its output"):
                self._accept_token(req, result, i)
                if not req.finished:
                    self._maybe_stream(req)
            if req.finished:
                finished.append(req)
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
        if result.grammar_status is not None:
            grammar_finish(req, result.grammar_status[i], result.next_token_ids[i])
        self.stop_checker.check(req)

    def _record_input_logprobs(self, req: Req, batch: WorkerBatch, i: int, result: BatchResult) -> None:
        if not req.input_token_logprobs and req.logprob_start_len == 0:
            req.input_token_logprobs.append((None, req.origin_input_ids[0]))
            if req.top_logprobs_num > 0:
                req.input_top_logprobs.append(None)
        targets = batch.input_logprob_targets[i]
        # none computed in this chunk (e.g. a one-token prompt): only the entry above applies
        for j, (lp, tok) in enumerate(zip(result.input_logprobs[i] or [], targets)):
            req.input_token_logprobs.append((lp, tok))
            if req.top_logprobs_num > 0:
                req.input_top_logprobs.append(result.input_top_logprobs[i][j])

    def _finish(self, req: Req, reason: FinishReason, insert: bool) -> None:
        """Terminal state: the request's one exit for KV and its one final output."""
        req.finish_reason = reason
        req.to_finish = None
        req.status = ReqStatus.FINISHED
        req.grammar = None  # release the matcher (a launched batch keeps its own reference)
        req.finished_time = time.perf_counter()
        if req.inflight > 0:
            self.pending_release[id(req)] = req  # a launched batch may still write its KV
        else:
            self.cache.release(req, insert=insert)
            self._on_released(req)
        self.stats["num_finished"] += 1
        self._emit(req)

    def _on_released(self, req: Req) -> None:
        """Cancel latency: the abort call to the moment the request's KV is returned."""
        if req.abort_sent_time is None or req.finish_reason is None or req.finish_reason.type != "abort":
            return
        now = time.time()
        latency = max(0.0, now - req.abort_sent_time)
        self.cancel_latencies.append(latency)
        self.recent_cancels.append((req.rid, req.abort_sent_time, now))
        h = self.cancel_hist
        h["sum"] += latency
        h["count"] += 1
        for i, bound in enumerate(h["buckets"]):
            if latency <= bound:
                h["counts"][i] += 1

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
        lat = sorted(self.cancel_latencies)
        cancel = {"count": len(lat), "p50": lat[len(lat) // 2] if lat else None,
                  "p99": lat[min(len(lat) - 1, int(len(lat) * 0.99))] if lat else None}
        return {"cancel_latency_s": cancel, "cancel_latency_hist": self.cancel_hist,
                "recent_cancels": [list(c) for c in self.recent_cancels], "paused": self.paused, "overlap": self.overlap,
                "forward_idle_fraction": round(self.timer.idle_fraction(), 4),
                "memory": self.cache.memory_stats(), "num_running_reqs": len(self.running),
                "num_waiting_reqs": len(self.waiting) + (1 if self.chunked_req else 0),
                # prefill work still queued, in tokens (the load a fleet gateway balances on)
                "num_waiting_tokens": sum(r.seqlen for r in self.waiting)
                + (self.chunked_req.seqlen - self.chunked_req.kv_committed_len if self.chunked_req else 0),
                "num_grammar_queue_reqs": len(self.grammar_queue), **self.grammar_queue.stats,
                "new_token_ratio": self.ratio.value, "evicted_tokens_total": self.cache.evicted_tokens_total,
                **self.stats, **(self.runner.info() if hasattr(self.runner, "info") else {}),
                **({"hicache": h} if (h := self.cache.hicache_stats()) is not None else {})}
