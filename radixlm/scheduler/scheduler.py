"""The scheduler: a loop over admission, decode, retraction and result processing.

One iteration (`step`) is nano-vllm's three calls: `schedule()` a batch (prefill first, else
decode), run it, `postprocess()` a result. With overlap scheduling the result processed is the
previous batch's, while the new one runs. Messages (`handle`) are applied between iterations,
never in the middle of one. Where every request is, and its one way out (`stop`, `finish`),
is `RequestLifecycle` (lifecycle.py), the port plug-ins act through (port.py); a forward's
tokens are accepted and its requests settled in settle.py, whoever ran the forward.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from radixlm.core import FinishReason, Req
from radixlm.messages import AbortReq, BatchTokenOut
from radixlm.rank_sync import LOCAL_RANK, RankSync
from radixlm.scheduler import abort_watch, control
from radixlm.scheduler.batch import BatchResult, ModelRunnerProtocol, WorkerBatch
from radixlm.scheduler.batch_builder import decode_batch, prefill_batch
from radixlm.scheduler.cache_manager import CacheManager
from radixlm.scheduler.config import SchedulerConfig
from radixlm.scheduler.grammar_queue import GrammarBackend
from radixlm.scheduler.lifecycle import RequestLifecycle
from radixlm.scheduler.output import Tokenizer, record_input_logprobs
from radixlm.scheduler.overlap import ForwardWorker, InFlight
from radixlm.scheduler.policy import make_policy
from radixlm.scheduler.port import StepHooks, TransferHooks
from radixlm.scheduler.prefill import AddStatus, PrefillAdder
from radixlm.scheduler.requests import Place
from radixlm.scheduler.retract import RETRACT_DECODE_STEPS, NewTokenRatioTracker, retraction_order
from radixlm.scheduler.settle import settle_decoded, settle_prefilled
from radixlm.scheduler.speculation import Speculation
from radixlm.scheduler.step_log import StepLog

logger = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "retract", "in_place")


class Scheduler(RequestLifecycle):
    """The loop; where requests are and how they end is `RequestLifecycle` (lifecycle.py), the
    port plug-ins act through. Every feature is handed in built: `speculation`, `transfer` (a
    disaggregation side), `hooks`, `inbox` (overlap on one rank: the process's inbox, read while
    a forward runs, abort_watch.py) and `ranks`."""

    def __init__(self, config: SchedulerConfig, runner: ModelRunnerProtocol, cache: CacheManager, *,
                 tokenizer: Tokenizer | None = None, send_output: Callable[[BatchTokenOut], None] | None = None,
                 grammar_backend: GrammarBackend | None = None, ranks: RankSync = LOCAL_RANK,
                 speculation: Speculation | None = None, transfer: TransferHooks | None = None,
                 hooks: Sequence[StepHooks] = (), inbox: abort_watch.Inbox | None = None) -> None:
        super().__init__(config, runner, cache, tokenizer=tokenizer, send_output=send_output,
                         grammar_backend=grammar_backend, ranks=ranks, speculation=speculation,
                         transfer=transfer, hooks=hooks)
        self.policy = make_policy(config.schedule_policy, cache, config.random_seed)
        self.ratio = NewTokenRatioTracker(config.schedule_conservativeness)
        self._ratio_before_decode_step = self.ratio.value  # (_unbuild_decode)
        self.overlap = config.overlap
        self.worker = ForwardWorker(runner, cache.before_forward, threaded=config.overlap)
        self.timer = self.worker.timer
        self.inbox = inbox
        self.paused = False
        self._chunk_since_decode = False  # the last batch left a prompt mid-way (see _decode_turn)
        self.step_log = StepLog(config.decode_log_interval)

    # ================================================================ messages
    def handle(self, msg: object) -> object:
        return control.dispatch(self, msg)

    def pause(self, mode: str) -> bool:
        """Stop scheduling. abort: answer everything; retract: running requests go back to
        waiting and their KV to the tree; in_place: keep requests and KV as they are."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"unknown pause mode {mode!r}")
        self.sync()
        self.paused = True
        if mode == "abort":
            self.abort(AbortReq(abort_all=True))
        elif mode == "retract":
            for req in self.requests.reqs(Place.RUNNING, Place.CHUNKED):
                self.retract(req)
            self.flush()
        return True

    def resume(self) -> bool:
        self.paused = False
        return True

    def flush_cache(self) -> bool:
        if not self.is_idle():
            logger.warning("cache not flushed: requests are still pending")
            return False
        self.forget_drafts()  # (session-held KV first: its slots are about to be reset)
        self.cache.flush()
        return True

    def get_info(self) -> dict[str, Any]:
        return control.server_info(self)

    # ================================================================ the loop
    def step(self) -> bool:
        """One iteration; False when there was nothing to do."""
        self.cache.poll()  # HiCache: acks of finished host copies unlock their nodes
        for hook in self.hooks:
            hook.poll()
        self.check_timeouts()
        self._admit_compiled()
        chunk_since_decode = self._chunk_since_decode
        batch = self.schedule()
        if batch is not None and self._abort_arrived_for(batch):
            self._unbuild_decode(batch, chunk_since_decode)
            return True  # the loop applies the abort now; the step is built again without it
        launched = self._launch(batch) if batch is not None else None
        done, self.in_flight = (self.in_flight, launched) if self.overlap else (launched, None)
        if batch is None and done is None:
            return self._idle()
        if done is not None:
            if launched is not None and self.in_flight is launched:
                self._watch_aborts(done, launched)
            self.postprocess(done.batch, self.boundary.resolve(done, self.in_flight))
        self._end_step()
        return True

    def _watch_aborts(self, running: InFlight, queued: InFlight) -> None:
        """Overlap: while `running` computes, an abort naming a request of `queued` takes
        `queued` back if it has not started, so the abort (applied by the loop after this
        step) finds nothing in flight and the KV is back when `running` ends."""
        if self.inbox is None or not abort_watch.can_take_back(queued):  # (no inbox on TP ranks)
            return
        if abort_watch.watch(self.inbox, running, queued):
            self.in_flight = None
            self._take_back(queued.batch, running)

    def _abort_arrived_for(self, batch: WorkerBatch) -> bool:
        """Nothing in flight (overlap off, or its first batch): an abort that arrived while
        `batch` was built and names one of its requests (abort_watch.aborted_before_launch)."""
        return (self.inbox is not None and self.in_flight is None
                and abort_watch.aborted_before_launch(self.inbox, batch))

    def _unbuild_decode(self, batch: WorkerBatch, chunk_since_decode: bool) -> None:
        """Undo `get_decode_batch` for a batch that was never launched: each request's decode
        slot goes back, and the step's bookkeeping is as it was (retractions made to fit it stay,
        with their effect on the new-token ratio)."""
        for req in batch.reqs:
            self.cache.rollback(req, 1)
        self.stats.num_decode_tokens -= len(batch.reqs)
        self.stats.num_batches_unbuilt += 1
        self.ratio.value = self._ratio_before_decode_step
        self._chunk_since_decode = chunk_since_decode
        if self.config.debug_check_integrity:
            self.check_integrity()
        self.flush()  # what this iteration produced before the batch (timeouts, grammars)

    def _take_back(self, batch: WorkerBatch, running: InFlight) -> None:
        """Undo `_launch` and `decode_batch` for a decode batch that never ran: its requests
        are as they were before it was built (one uncommitted decode slot fewer each)."""
        in_running = {id(r) for r in running.batch.reqs}
        for req in batch.reqs:
            req.last_launch_time = running.launched_at if id(req) in in_running else None
            req.inflight -= 1
            req.pending_tokens -= 1
            self.cache.rollback(req, 1)
        self.stats.num_decode_tokens -= len(batch.reqs)
        self.stats.num_batches_taken_back += 1

    def run_until_idle(self) -> None:
        while self.step():
            pass

    def schedule(self) -> WorkerBatch | None:
        """The next batch: prefill when any request can be admitted, else a decode step; between
        the chunks of a long prompt, a decode step first (interleave_chunked_prefill)."""
        if self.in_flight is not None and (not self.in_flight.batch.is_decode or self.boundary.must_sync):
            # a prefill's requests join decode only once its result is known; a batch to be
            # replayed (error_boundary.py) is processed before another is built on it
            self.sync()
        if self.paused:
            return None
        if self._decode_turn():
            batch = self.get_decode_batch()
            if batch is not None:
                self._chunk_since_decode = False
                return batch
        batch = self.get_prefill_batch()
        if batch is not None:
            self._chunk_since_decode = not all(batch.sample)  # a prompt continues in a later chunk
        elif self.requests.count(Place.RUNNING):
            batch = self.get_decode_batch()
            self._chunk_since_decode = False
        return batch

    def _decode_turn(self) -> bool:
        """Whether the decoding requests get a step before a long prompt's next chunk: without
        it they wait for the whole prompt (every chunk is a full forward of its own)."""
        return (self.config.interleave_chunked_prefill and self._chunk_since_decode
                and self.chunked_req is not None and self.requests.count(Place.RUNNING) > 0)

    def sync(self) -> None:
        """Process the launched batch now (pause, flush, retraction and weight updates need
        nothing in flight)."""
        if self.in_flight is not None:
            prev, self.in_flight = self.in_flight, None
            self.postprocess(prev.batch, self.boundary.resolve(prev, None))
            self.flush()

    def _launch(self, batch: WorkerBatch) -> InFlight:
        now = time.time()
        for req, samples in zip(batch.reqs, batch.sample, strict=True):
            req.last_launch_time = now
            req.inflight += 1
            if samples:
                req.pending_tokens += 1
        launched = self.worker.submit(batch)
        launched.launched_at = now
        return launched

    def _end_step(self) -> None:
        self.stats.num_steps += 1
        if self.config.debug_check_integrity:
            self.check_integrity()
        self.flush()

    def _idle(self) -> bool:
        """Nothing to run. Returns False (the caller may block on its inbox) unless a grammar
        is compiling: then wait briefly for it and report progress, so the request moves on
        as soon as its compile is done."""
        self.ratio.on_idle()
        self.flush()
        if self.grammar_queue:
            self.grammar_queue.wait()
            return True
        return False

    def _admit_compiled(self) -> None:
        """Compiled grammars: their requests start waiting; failed compiles are answered (400)."""
        if not self.grammar_queue:
            return
        ready, failed = self.grammar_queue.pop_ready()
        for req in ready:
            self.requests.put(req, Place.WAITING)
        for req, reason in failed:
            self.requests.remove(req)
            self.finish(req, reason)

    # ================================================================ batch choice
    def get_prefill_batch(self) -> WorkerBatch | None:
        if self.priority is not None and self.priority.may_preempt(self.waiting, self.running):
            self.sync()  # a preemption victim must not be in a launched batch
        chunked, waiting = self.chunked_req, self.waiting
        if not waiting and chunked is None:
            return None
        cfg = self.config
        # Chunks are cost-bounded only while requests decode (prefill.py): a decode step follows
        # each chunk then, and waits for it.
        bound = cfg.chunk_cost_keys if cfg.interleave_chunked_prefill and self.running else None
        adder = PrefillAdder(self.cache, self.running, self.ratio.value, cfg.max_prefill_tokens,
                             cfg.chunked_prefill_size, cfg.max_running_requests, cfg.page_size,
                             chunk_cost_keys=bound, sessions=self.sessions)
        status = AddStatus.CONTINUE
        if chunked is not None:
            status = adder.add_chunked_req(chunked)
        if status is AddStatus.CONTINUE:
            order = self.policy.order(waiting)
            preempted: list[Req] = []
            for req in order if self.priority is None else self.priority.order(order):
                if preempted and req.priority <= max(r.priority for r in preempted):
                    break  # a request preempted now is not passed by one it outranks or equals
                status = self.boundary.admit(adder, req)
                if self.priority is not None and status is not AddStatus.CONTINUE:
                    status, taken = self.priority.admit_preempting(
                        adder, req, status, self.running, lambda r: self.boundary.admit(adder, r), self.retract)
                    self._retracted(taken, f"preempted for {req.rid}")
                    preempted += taken
                if status is not AddStatus.CONTINUE or adder.plan.new_chunked_req is not None:
                    break
        plan = adder.plan
        if not plan.reqs:
            return None
        now, cached = self.ranks.now(), 0
        for req, prefix, extend in zip(plan.reqs, plan.prefix_lens, plan.extend_lens, strict=True):
            self.requests.put(req, Place.PREFILL)  # back to CHUNKED in postprocess if a chunk remains
            if req.admit_time is None:
                req.admit_time = now
            self.stats.num_prefill_tokens += extend
            cached += prefix if prefix == req.prefix_len else 0  # a prefix hit, not an earlier chunk
        self.stats.num_cached_tokens += cached
        self.step_log.prefill(self.cache, len(plan.reqs), sum(plan.extend_lens), cached,
                              self.requests.count(Place.RUNNING), self.requests.count(Place.WAITING))
        return prefill_batch(plan)

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
        if self.speculation is not None:
            batch = self.speculation.batch(reqs)
        else:
            batch = decode_batch(reqs, self.cache, self.in_flight.batch if self.in_flight is not None else None,
                                 self.overlap)
        self._ratio_before_decode_step = self.ratio.value  # what _unbuild_decode restores
        self.ratio.on_decode_step()
        self.stats.num_decode_tokens += len(reqs)
        self.step_log.decode(self.cache, len(reqs), self.stats.num_decode_tokens, self.requests.count(Place.WAITING))
        return batch

    def _decode_candidates(self) -> list[Req]:
        """Running requests that need another token: not being aborted, and not certain to
        reach max_new_tokens with the token already in flight."""
        return self.requests.find(lambda r: r.to_finish is None and len(r.output_ids) + r.pending_tokens
                                  < r.sampling_params.max_new_tokens, Place.RUNNING)

    # ================================================================ retraction
    def _decode_fits(self, num_reqs: int, steps: int) -> bool:
        return self.cache.make_room(num_reqs * steps * self.config.page_size)

    def _ensure_decode_memory(self) -> None:
        if self._decode_fits(self.requests.count(Place.RUNNING), 1):
            return
        order = retraction_order(self.running, self.config.retraction_policy)
        retracted = []
        while len(order) > 1 and not self._decode_fits(len(order), RETRACT_DECODE_STEPS):
            retracted.append(order.pop())
            self.retract(retracted[-1])
        self._retracted(retracted, "decode out of KV")
        if not self._decode_fits(self.requests.count(Place.RUNNING), 1):
            # A single request that cannot get one more slot: answer it instead of crashing.
            for req in self.running:
                self.stop(req, FinishReason.abort("out of memory: the KV cache cannot hold this request",
                                                  status_code=500))

    def _retracted(self, reqs: list[Req], why: str) -> None:
        """After `retract` of `reqs` (decode room, or priority preemption): one bookkeeping."""
        if reqs:
            self.stats.num_retractions += len(reqs)
            self.ratio.on_retract(self.running)
            logger.info("retracted %d request(s) (%s); new_token_ratio -> %.3f", len(reqs), why, self.ratio.value)

    # ================================================================ results
    def postprocess(self, batch: WorkerBatch, result: BatchResult) -> None:
        for req, samples in zip(batch.reqs, batch.sample, strict=True):
            req.inflight -= 1
            if samples:
                req.pending_tokens -= 1
        if batch.is_decode:
            self.process_decode_result(batch, result)
        else:
            self.process_prefill_result(batch, result)
        for req in batch.reqs:
            if req.inflight == 0 and self.requests.where(req) is Place.RELEASING:
                self.requests.remove(req)
                self.release_kv(req, True)
                self.on_released(req)

    def process_prefill_result(self, batch: WorkerBatch, result: BatchResult) -> None:
        for i, req in enumerate(batch.reqs):
            self.cache.commit(req, batch.extend_lens[i])
            if req.to_finish is not None:  # aborted while this batch was in flight
                self.finish(req, req.to_finish)
                continue
            if req.return_logprob and req.logprob_start_len >= 0 and not req.output_ids:
                # also when this chunk computed none (a one-token prompt): position 0's entry
                with self.boundary.guard(req, "recording its prompt logprobs"):
                    record_input_logprobs(req, batch.input_logprob_targets[i], result, i)
                if req.finish_reason is not None:  # that failed: the request ends here
                    self.finish(req, req.finish_reason)
                    continue
            if not batch.sample[i]:
                self.cache.cache_prefill(req)
                self.requests.put(req, Place.CHUNKED)
                continue
            self.advance(req, result.next_token_ids[i:i + 1], result.logprobs[i:i + 1],
                         result.top_logprobs[i:i + 1],
                         result.grammar_status[i] if result.grammar_status is not None else None)
            if not any(hook.take_prefilled(req) for hook in self.hooks):
                settle_prefilled(self, req)

    def process_decode_result(self, batch: WorkerBatch, result: BatchResult) -> None:
        if batch.drafts is not None:
            assert self.speculation is not None
            self.speculation.process_result(self, batch, result)
            return
        rows: list[Req] = []
        for i, req in enumerate(batch.reqs):
            if req.finished:
                continue  # finished while this batch was in flight: its extra slot is freed on release
            self.cache.commit(req, 1)
            self.advance(req, result.next_token_ids[i:i + 1], result.logprobs[i:i + 1],
                         result.top_logprobs[i:i + 1],
                         result.grammar_status[i] if result.grammar_status is not None else None)
            rows.append(req)
        settle_decoded(self, rows)
