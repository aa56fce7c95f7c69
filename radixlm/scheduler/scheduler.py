"""The scheduler: a loop over admission, decode, retraction and result processing.

One iteration (`step`) is nano-vllm's three calls: `schedule()` a batch (prefill first, else
decode), run it, `postprocess()` a result. With overlap scheduling the result processed is the
previous batch's, while the new one runs. Messages (`handle`) are applied between iterations,
never in the middle of one. Where every request is lives in one table (`requests`); every
request ends through `stop` (now, or when the launched batch holding it is processed) and
`finish`, its one exit for KV and its one final output.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from radixlm.core import FinishReason, Req
from radixlm.messages import AbortReq, BatchTokenOut, ReqOutput, TokenizedGenerateReq
from radixlm.rank_sync import LOCAL_RANK, RankSync
from radixlm.scheduler import abort_watch, control
from radixlm.scheduler.abort import abort_matcher
from radixlm.scheduler.batch import BatchResult, ModelRunnerProtocol, WorkerBatch
from radixlm.scheduler.batch_builder import decode_batch, prefill_batch
from radixlm.scheduler.cache_manager import CacheManager
from radixlm.scheduler.config import SchedulerConfig
from radixlm.scheduler.error_boundary import ErrorBoundary
from radixlm.scheduler.grammar_queue import GrammarBackend, GrammarQueue
from radixlm.scheduler.output import StopStringChecker, Tokenizer, accept_token, make_output, record_input_logprobs
from radixlm.scheduler.overlap import ForwardWorker, InFlight
from radixlm.scheduler.policy import make_policy
from radixlm.scheduler.prefill import AddStatus, PrefillAdder
from radixlm.scheduler.requests import HOLDS_KV, Place, RequestTable
from radixlm.scheduler.retract import RETRACT_DECODE_STEPS, NewTokenRatioTracker, retraction_order
from radixlm.scheduler.speculation import Speculation
from radixlm.scheduler.stats import CancelLatency, SchedulerStats
from radixlm.scheduler.transfer_hooks import TransferHooks
from radixlm.scheduler.validate import check_new_request, deadline_passed

logger = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "retract", "in_place")
# An abort looks for its requests in this order (the order of their final outputs).
ABORTABLE = (Place.WAITING, Place.GRAMMAR, Place.CHUNKED, Place.PREFILL, Place.RUNNING, Place.TRANSFER)


class Scheduler:
    def __init__(self, config: SchedulerConfig, runner: ModelRunnerProtocol, cache: CacheManager, *,
                 tokenizer: Tokenizer | None = None, send_output: Callable[[BatchTokenOut], None] | None = None,
                 grammar_backend: GrammarBackend | None = None, ranks: RankSync = LOCAL_RANK) -> None:
        self.config = config
        self.runner = runner
        self.cache = cache
        self.policy = make_policy(config.schedule_policy, cache, config.random_seed)
        self.ratio = NewTokenRatioTracker(config.schedule_conservativeness)
        self._ratio_before_decode_step = self.ratio.value  # (_unbuild_decode)
        self.stop_checker = StopStringChecker(tokenizer)
        self.send_output = send_output or (lambda out: None)
        self.requests = RequestTable()
        # The clock of timeouts and queue order; tensor-parallel ranks share rank 0's (rank_sync.py).
        self.ranks = ranks
        # structured-output requests wait (Place.GRAMMAR) for their compile here (semantics §1)
        self.grammar_queue = GrammarQueue(grammar_backend, ranks=ranks)
        self.overlap = config.overlap
        self.worker = ForwardWorker(runner, cache.before_forward, threaded=config.overlap)
        self.timer = self.worker.timer
        self.in_flight: InFlight | None = None  # overlap: the batch launched, result not processed
        # overlap on one rank: the process's inbox, read while a forward runs (abort_watch.py)
        self.inbox: abort_watch.Inbox | None = None
        self._pending_out: list[ReqOutput] = []
        self.paused = False
        self._chunk_since_decode = False  # the last batch left a prompt mid-way (see _decode_turn)
        self.stats = SchedulerStats()
        self.cancel_latency = CancelLatency()
        self.boundary = ErrorBoundary(self)  # one request's failure ends that request only
        self.speculation: Speculation | None = None  # n-gram drafts verified each decode step
        if config.speculative is not None:
            if config.overlap:
                from radixlm.speculative.setup import WHY_NO_OVERLAP
                raise ValueError(f"speculative decoding refuses overlap scheduling: {WHY_NO_OVERLAP}")
            self.speculation = Speculation(config.speculative, cache, runner.max_context_len, runner.vocab_size)
        # prefill/decode disaggregation (radixlm/disaggregation): set by its builder
        self.transfer: TransferHooks | None = None
        # entries get_info adds from the process running this scheduler (its GC counters)
        self.process_info: Callable[[], dict[str, Any]] | None = None

    # ================================================================ where requests are
    @property
    def waiting(self) -> list[Req]:
        return self.requests.reqs(Place.WAITING)

    @property
    def running(self) -> list[Req]:
        return self.requests.reqs(Place.RUNNING)

    @property
    def chunked_req(self) -> Req | None:
        return self.requests.first(Place.CHUNKED)

    def in_flight_reqs(self) -> set[int]:
        """ids of requests inside a launched batch whose result is not processed yet (only the
        overlap loop has one between iterations)."""
        return {id(r) for r in self.in_flight.batch.reqs} if self.in_flight is not None else set()

    def live_reqs(self) -> list[Req]:
        """Every request that holds KV right now."""
        return self.requests.find(lambda r: r.req_pool_idx is not None, *HOLDS_KV)

    def is_idle(self) -> bool:
        return not self.requests and self.in_flight is None

    # ================================================================ messages
    def handle(self, msg: object) -> object:
        return control.dispatch(self, msg)

    def add_request(self, msg: TokenizedGenerateReq) -> None:
        req = Req(rid=msg.rid, origin_input_ids=list(msg.input_ids), sampling_params=msg.sampling_params,
                  eos_token_ids=frozenset(self.runner.eos_token_ids), return_logprob=msg.return_logprob,
                  top_logprobs_num=msg.top_logprobs_num, logprob_start_len=msg.logprob_start_len,
                  token_ids_logprob=msg.token_ids_logprob,
                  extra_key=msg.extra_key, priority=msg.priority, stream=msg.stream, timeout=msg.timeout,
                  created_time=self.ranks.now(), bootstrap=msg.bootstrap)
        if self.speculation is not None:
            self.speculation.state(req)  # meta_info reports spec_* from the first output on
        error = check_new_request(req, self.runner, self.cache.capacity, self.grammar_queue.available)
        limit = self.config.max_queued_requests
        if error is None and limit is not None and self.requests.count(Place.WAITING, Place.GRAMMAR) >= limit:
            self.stats.num_rejected += 1
            error = (f"the queue is full ({limit} waiting requests)", 503)
        if error is not None:
            req.finish_reason = FinishReason.abort(error[0], status_code=error[1])
            if self.transfer is not None:
                self.transfer.on_finish(req)  # the peer answers its side of the room with the error
            self._emit(req)
            self._flush_outputs()
            return
        if self.transfer is not None and self.transfer.take_new(req):
            return
        grammar = req.sampling_params.grammar
        if grammar is not None:
            self.requests.put(req, Place.GRAMMAR)
            self.grammar_queue.add(req, grammar)  # check_new_request made sure there is a backend
            return
        self.requests.put(req, Place.WAITING)

    def abort(self, msg: AbortReq) -> int:
        """Apply an abort at the top of an iteration; returns how many requests it hit."""
        named = abort_matcher(msg)
        hits = self.requests.find(lambda r: r.to_finish is None and not r.finished and named(r.rid), *ABORTABLE)
        for req in hits:
            req.abort_sent_time = msg.sent_time or None
            self.stats.count_abort(self.stop(req, FinishReason.abort()))
        self.stats.num_aborted += len(hits)
        self._flush_outputs()
        return len(hits)

    def stop(self, req: Req, reason: FinishReason) -> str:
        """End `req` with `reason`: now, or, while a launched batch holds it (its KV is being
        written), when that batch's result is processed (the step's token is then dropped).
        Returns where it was stopped: its place, or "in_flight"."""
        if id(req) in self.in_flight_reqs():
            req.to_finish = reason
            return "in_flight"
        place = self.requests.remove(req)
        assert place is not Place.PREFILL, "a prefill request outside the launched batch"
        if place is Place.GRAMMAR:
            self.grammar_queue.remove(req)  # cancel its compile if nobody else waits for it
        self.finish(req, reason)
        return place.name.lower()

    def check_timeouts(self) -> None:
        """Per-request deadlines and the server-wide waiting/running limits (503)."""
        now = self.ranks.now()
        for waiting, places in ((True, (Place.WAITING, Place.GRAMMAR, Place.TRANSFER)),
                                (False, (Place.RUNNING, Place.CHUNKED))):
            for req in self.requests.find(lambda r: r.to_finish is None, *places):
                why = deadline_passed(req, now, waiting, self.config)
                if why:
                    self.stats.num_timeouts += 1
                    self.stop(req, FinishReason.abort(why, status_code=503))

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
                self._retract(req)
            self._flush_outputs()
        return True

    def resume(self) -> bool:
        self.paused = False
        return True

    def flush_cache(self) -> bool:
        if not self.is_idle():
            logger.warning("cache not flushed: requests are still pending")
            return False
        self.cache.flush()
        if self.speculation is not None:
            self.speculation.flush()
        return True

    def get_info(self) -> dict[str, Any]:
        return control.server_info(self)

    def check_integrity(self) -> None:
        self.cache.check_integrity(self.live_reqs())

    # ================================================================ the loop
    def step(self) -> bool:
        """One iteration; False when there was nothing to do."""
        self.cache.poll()  # HiCache: acks of finished host copies unlock their nodes
        if self.transfer is not None:
            self.transfer.poll()
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
            self.postprocess(done.batch, self.boundary.resolve(done))
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
        self._flush_outputs()  # what this iteration produced before the batch (timeouts, grammars)

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
            self.postprocess(prev.batch, self.boundary.resolve(prev))
            self._flush_outputs()

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
        self._flush_outputs()

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
        chunked, waiting = self.chunked_req, self.waiting
        if not waiting and chunked is None:
            return None
        cfg = self.config
        # Chunks are cost-bounded only while requests decode (prefill.py): a decode step follows
        # each chunk then, and waits for it.
        bound = cfg.chunk_cost_keys if cfg.interleave_chunked_prefill and self.running else None
        adder = PrefillAdder(self.cache, self.running, self.ratio.value, cfg.max_prefill_tokens,
                             cfg.chunked_prefill_size, cfg.max_running_requests, cfg.page_size,
                             chunk_cost_keys=bound)
        status = AddStatus.CONTINUE
        if chunked is not None:
            status = adder.add_chunked_req(chunked)
        if status is AddStatus.CONTINUE:
            for req in self.policy.order(waiting):
                status = self.boundary.admit(adder, req)
                if status is not AddStatus.CONTINUE or adder.plan.new_chunked_req is not None:
                    break
        plan = adder.plan
        if not plan.reqs:
            return None
        now = self.ranks.now()
        for req, prefix, extend in zip(plan.reqs, plan.prefix_lens, plan.extend_lens, strict=True):
            self.requests.put(req, Place.PREFILL)  # back to CHUNKED in postprocess if a chunk remains
            if req.admit_time is None:
                req.admit_time = now
            self.stats.num_prefill_tokens += extend
            self.stats.num_cached_tokens += prefix if prefix == req.prefix_len else 0
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
        retracted = 0
        while len(order) > 1 and not self._decode_fits(len(order), RETRACT_DECODE_STEPS):
            self._retract(order.pop())
            retracted += 1
        if retracted:
            self.stats.num_retractions += retracted
            self.ratio.on_retract(self.running)
            logger.info("retracted %d request(s); new_token_ratio -> %.3f", retracted, self.ratio.value)
        if not self._decode_fits(self.requests.count(Place.RUNNING), 1):
            # A single request that cannot get one more slot: answer it instead of crashing.
            for req in self.running:
                self.stop(req, FinishReason.abort("out of memory: the KV cache cannot hold this request",
                                                  status_code=500))

    def _retract(self, req: Req) -> None:
        """Back to waiting (preemption is free + requeue): computed KV goes to the tree,
        reused on resume if it survives."""
        self.cache.release(req, insert=True)
        req.num_retractions += 1
        if not req.output_ids:
            # retracted during chunked prefill: the prompt is recomputed from the cache match,
            # and with it the input logprobs recorded so far
            req.input_token_logprobs.clear()
            req.input_top_logprobs.clear()
        self.requests.put(req, Place.WAITING)
        # The front end learns of it now (num_retractions): it answers an abort by itself.
        self._pending_out.append(make_output(req, include_input_logprobs=False))

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
                self.cache.release(req, insert=True)
                self._on_released(req)

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
            if req.sampling_params.max_new_tokens == 0:
                req.finish_reason = FinishReason("length", length=0)
            else:
                with self.boundary.guard(req, "processing its output"):
                    accept_token(req, result, i, self.stop_checker)
            if self.transfer is not None and self.transfer.take_prefilled(req):
                continue
            if req.finish_reason is not None:
                self.finish(req, req.finish_reason)
            else:
                self.cache.cache_prefill(req)
                self.requests.put(req, Place.RUNNING)
                self.stream_if_due(req)

    def process_decode_result(self, batch: WorkerBatch, result: BatchResult) -> None:
        if batch.drafts is not None:
            assert self.speculation is not None
            self.speculation.process_result(self, batch, result)
            return
        finished: list[Req] = []
        for i, req in enumerate(batch.reqs):
            if req.finished:
                continue  # finished while this batch was in flight: its extra slot is freed on release
            self.cache.commit(req, 1)
            with self.boundary.guard(req, "processing its output"):
                accept_token(req, result, i, self.stop_checker)
                if req.finish_reason is None:
                    self.stream_if_due(req)
            if req.finish_reason is not None:
                finished.append(req)
        for req in finished:
            assert req.finish_reason is not None
            self.finish(req, req.finish_reason)

    def finish(self, req: Req, reason: FinishReason, insert: bool = True) -> None:
        """Terminal state: the request's one exit for KV and its one final output. For a
        request in no place or one the caller has just removed; everything else goes
        through `stop`, which knows about launched batches."""
        self.requests.discard(req)
        req.finish_reason = reason
        req.to_finish = None
        req.grammar = None  # release the matcher (a launched batch keeps its own reference)
        req.finished_time = time.perf_counter()
        if self.transfer is not None:
            self.transfer.on_finish(req)  # before the release: no chunk is written after it
        if req.inflight > 0:
            self.requests.put(req, Place.RELEASING)  # a launched batch may still write its KV
        else:
            if req.req_pool_idx is not None:
                self.cache.release(req, insert=insert)
            self._on_released(req)
        self.stats.num_finished += 1
        if self.speculation is not None:
            self.speculation.on_finish(req)
        self._emit(req)

    def _on_released(self, req: Req) -> None:
        """A finished request's KV is back: the cancel latency (abort call -> KV returned)."""
        reason = req.finish_reason
        if req.abort_sent_time is not None and reason is not None and reason.type == "abort":
            self.cancel_latency.add(req.rid, req.abort_sent_time, time.time(), req.last_launch_time)

    def stream_if_due(self, req: Req) -> None:
        """Queue `req`'s new tokens for the front end once stream_interval of them wait."""
        # Non-streamed requests too: the front end holds every token delivered, so it can
        # answer an abort at once with the output so far (it returns only the final result).
        if len(req.output_ids) - req.sent_len >= self.config.stream_interval:
            self._emit(req)

    def _emit(self, req: Req) -> None:
        self._pending_out.append(make_output(req, include_input_logprobs=req.sent_len == 0))

    def _flush_outputs(self) -> None:
        if self._pending_out:
            out, self._pending_out = self._pending_out, []
            self.send_output(BatchTokenOut(out))
