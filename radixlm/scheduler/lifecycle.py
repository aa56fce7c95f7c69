"""Where every request is, how it comes in and its one way out: the scheduler's side of the
port (`RequestOps`, port.py) that plug-ins act through.

A request enters through `add_request` (validated, then placed: waiting, compiling its
grammar, or taken by a hook) and ends through `stop` (now, or when the launched batch holding
it is processed) and `finish`, its one exit for KV and its one final output. The loop that
schedules and runs batches is `Scheduler` (scheduler.py), built on this class.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from radixlm.core import FinishReason, Req
from radixlm.feature_rules import check_scheduler_features
from radixlm.messages import AbortReq, BatchTokenOut, ReqOutput, SessionParams, TokenizedGenerateReq
from radixlm.rank_sync import LOCAL_RANK, RankSync
from radixlm.scheduler.abort import abort_matcher
from radixlm.scheduler.batch import ModelRunnerProtocol
from radixlm.scheduler.cache_manager import CacheManager
from radixlm.scheduler.config import SchedulerConfig
from radixlm.scheduler.error_boundary import ErrorBoundary
from radixlm.scheduler.grammar_queue import GrammarBackend, GrammarQueue
from radixlm.scheduler.output import StopStringChecker, Tokenizer, make_output
from radixlm.scheduler.overlap import InFlight
from radixlm.scheduler.port import StepHooks, TransferHooks
from radixlm.scheduler.priority import PriorityScheduling
from radixlm.scheduler.requests import HOLDS_KV, Place, RequestTable
from radixlm.scheduler.sessions import SessionError, SessionTable
from radixlm.scheduler.settle import accept
from radixlm.scheduler.speculation import Speculation
from radixlm.scheduler.stats import CancelLatency, SchedulerStats
from radixlm.scheduler.validate import check_new_request, deadline_passed

__all__ = ["RequestLifecycle", "ABORTABLE"]

# An abort looks for its requests in this order (the order of their final outputs).
ABORTABLE = (Place.WAITING, Place.GRAMMAR, Place.CHUNKED, Place.PREFILL, Place.RUNNING, Place.TRANSFER)


class RequestLifecycle:
    """Features come built (speculation with its measured step cost, a disaggregation side,
    other hooks) and are bound here; nothing is attached after construction."""

    def __init__(self, config: SchedulerConfig, runner: ModelRunnerProtocol, cache: CacheManager, *,
                 tokenizer: Tokenizer | None = None, send_output: Callable[[BatchTokenOut], None] | None = None,
                 grammar_backend: GrammarBackend | None = None, ranks: RankSync = LOCAL_RANK,
                 speculation: Speculation | None = None, transfer: TransferHooks | None = None,
                 hooks: Sequence[StepHooks] = ()) -> None:
        check_scheduler_features(speculative=config.speculative is not None, overlap=config.overlap)
        self.config = config
        self.runner = runner
        self.cache = cache
        self.requests = RequestTable()
        # The clock of timeouts and queue order; tensor-parallel ranks share rank 0's (rank_sync.py).
        self.ranks = ranks
        # structured-output requests wait (Place.GRAMMAR) for their compile here (semantics §1)
        self.grammar_queue = GrammarQueue(grammar_backend, ranks=ranks)
        self.stop_checker = StopStringChecker(tokenizer)
        self.send_output = send_output or (lambda out: None)
        self._pending_out: list[ReqOutput] = []
        self.stats = SchedulerStats()
        self.cancel_latency = CancelLatency()
        self.in_flight: InFlight | None = None  # overlap: the batch launched, result not processed
        self.boundary = ErrorBoundary(self, runner)  # one request's failure ends that request only
        if speculation is None and config.speculative is not None:  # priced by the fixed line
            speculation = Speculation(config.speculative, cache, runner.max_context_len, runner.vocab_size)
        self.speculation = speculation  # n-gram drafts verified each decode step
        self.transfer = transfer  # prefill/decode disaggregation (radixlm/disaggregation)
        self.sessions = SessionTable(lambda r, insert: cache.release(r, insert=insert),
                                     lambda r: cache.rollback(r, r.kv_allocated_len - r.kv_committed_len))
        # priority scheduling (priority.py): ranks, preemption victims, queue overflow; None: off
        self.priority = (PriorityScheduling(config.priority, config.retraction_policy)
                         if config.priority is not None else None)
        self.hooks: list[StepHooks] = [h for h in (speculation, transfer, self.priority) if h is not None] + list(hooks)
        for hook in self.hooks:
            hook.bind(self)

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

    def find(self, pred: Callable[[Req], bool], *places: Place) -> list[Req]:
        return self.requests.find(pred, *places)

    def place(self, req: Req, where: Place) -> None:
        self.requests.put(req, where)

    def in_flight_reqs(self) -> set[int]:
        """ids of requests inside a launched batch whose result is not processed yet (only the
        overlap loop has one between iterations)."""
        return {id(r) for r in self.in_flight.batch.reqs} if self.in_flight is not None else set()

    def live_reqs(self) -> list[Req]:
        """Every request that holds KV right now."""
        return self.requests.find(lambda r: r.req_pool_idx is not None, *HOLDS_KV)

    def is_idle(self) -> bool:
        return not self.requests and self.in_flight is None

    def now(self) -> float:
        return self.ranks.now()

    def check_integrity(self) -> None:
        # session-held KV is owned by the finished turn that computed it, counted like a live request's
        self.cache.check_integrity(self.live_reqs() + self.sessions.held_reqs())

    # ================================================================ coming in
    def add_request(self, msg: TokenizedGenerateReq) -> None:
        error: tuple[str, int] | None = None
        prompt = list(msg.input_ids)
        if msg.session is not None:  # a session's turn: its history, then its input
            try:
                prompt = self.sessions.prompt(msg.session, prompt)
            except SessionError as e:
                error = (str(e), 400)
        req = Req(rid=msg.rid, origin_input_ids=prompt, sampling_params=msg.sampling_params,
                  eos_token_ids=frozenset(self.runner.eos_token_ids), return_logprob=msg.return_logprob,
                  top_logprobs_num=msg.top_logprobs_num, logprob_start_len=msg.logprob_start_len,
                  token_ids_logprob=msg.token_ids_logprob,
                  extra_key=msg.extra_key, stream=msg.stream, timeout=msg.timeout,
                  priority=self.priority.rank(msg.priority) if self.priority is not None else 0,
                  created_time=self.ranks.now(), bootstrap=msg.bootstrap)
        if self.speculation is not None:
            self.speculation.state(req)  # meta_info reports spec_* from the first output on
        error = error or check_new_request(req, self.runner, self.cache.capacity, self.grammar_queue.available)
        limit = self.config.max_queued_requests
        if error is None and limit is not None and self.requests.count(Place.WAITING, Place.GRAMMAR) >= limit:
            error = self._queue_full(req, limit)
        if error is None and msg.session is not None:
            self._start_turn(req, msg.session)  # (prompt() refused what it cannot take)
        if error is not None:
            req.finish_reason = FinishReason.abort(error[0], status_code=error[1])
            for hook in self.hooks:
                hook.on_finish(req)  # a disaggregation peer answers its side of the room with the error
            self.emit(req)
            self.flush()
            return
        if any(hook.take_new(req) for hook in self.hooks):
            return
        grammar = req.sampling_params.grammar
        if grammar is not None:
            self.requests.put(req, Place.GRAMMAR)
            self.grammar_queue.add(req, grammar)  # check_new_request made sure there is a backend
            return
        self.requests.put(req, Place.WAITING)

    def _start_turn(self, req: Req, params: SessionParams) -> None:
        """`req` becomes its session's turn; turns that `replace` drops are stopped."""
        for turn in self.sessions.start(req, params, self.ranks.now()):
            self.stop(turn, FinishReason.abort("replaced by a later turn of its session"))

    def _queue_full(self, req: Req, limit: int) -> tuple[str, int] | None:
        """The queue holds `limit` requests: `req`'s error (503), or None when priority
        scheduling turned a lower-priority queued request away for it instead."""
        self.stats.num_rejected += 1
        message = f"the queue is full ({limit} waiting requests)"
        prio = self.priority
        if prio is None:
            return message, 503
        victim = prio.queue_victim(req, self.requests.reqs(Place.WAITING))
        prio.count_rejected(victim or req)
        if victim is None:
            return message, 503
        self.stop(victim, FinishReason.abort(f"{message}: a request of higher priority took its place",
                                             status_code=503))
        self.flush()
        return None

    def reject(self, msg: TokenizedGenerateReq, exc: BaseException) -> None:
        """`add_request` raised for `msg`: answer it (500), wherever it got to."""
        self.boundary.reject(msg, exc)

    # ================================================================ going out
    def abort(self, msg: AbortReq) -> int:
        """Apply an abort at the top of an iteration; returns how many requests it hit."""
        named = abort_matcher(msg)
        hits = self.requests.find(lambda r: r.to_finish is None and not r.finished and named(r.rid), *ABORTABLE)
        for req in hits:
            req.abort_sent_time = msg.sent_time or None
            self.stats.count_abort(self.stop(req, FinishReason.abort()))
        self.stats.num_aborted += len(hits)
        if msg.abort_all:  # sessions stay open; their KV goes to the prefix cache
            self.sessions.drop_kv(insert=True)
        self.flush()
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
        for sid in self.sessions.expired(now):
            self.close_session(sid, "its session timed out")

    def open_session(self, capacity: int, timeout: float | None, session_id: str | None) -> str:
        if self.transfer is not None:  # a turn's KV would live on the other server
            raise SessionError("sessions are not available with prefill/decode disaggregation")
        return self.sessions.open(capacity, timeout, self.ranks.now(), session_id)

    def close_session(self, sid: str, why: str = "its session was closed") -> None:
        """The session's KV goes back; its turns still in flight end (abort)."""
        for turn in self.sessions.close(sid):
            self.stop(turn, FinishReason.abort(why))
        self.flush()

    def finish(self, req: Req, reason: FinishReason, insert: bool = True) -> None:
        """Terminal state: the request's one exit for KV and its one final output. For a
        request in no place or one the caller has just removed; everything else goes
        through `stop`, which knows about launched batches."""
        self.requests.discard(req)
        req.finish_reason = reason
        req.to_finish = None
        req.grammar = None  # release the matcher (a launched batch keeps its own reference)
        req.finished_time = time.perf_counter()
        for hook in self.hooks:
            hook.on_finish(req)  # before the release: no KV chunk is written after it
        if req.inflight > 0:
            self.requests.put(req, Place.RELEASING)  # a launched batch may still write its KV
        else:
            self.release_kv(req, insert)
            self.on_released(req)
        self.stats.num_finished += 1
        self.emit(req)

    def release_kv(self, req: Req, insert: bool) -> None:
        """A finished request's KV goes back (the cache manager's release), unless its session
        keeps it (sessions.py: a turn that ended normally)."""
        if self.sessions.keep(req, self.ranks.now(), usable=insert) or req.req_pool_idx is None:
            return
        self.cache.release(req, insert=insert)

    def on_released(self, req: Req) -> None:
        """A finished request's KV is back: the cancel latency (abort call -> KV returned)."""
        reason = req.finish_reason
        if req.abort_sent_time is not None and reason is not None and reason.type == "abort":
            self.cancel_latency.add(req.rid, req.abort_sent_time, time.time(), req.last_launch_time)

    def retract(self, req: Req) -> None:
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

    # ================================================================ progress
    def advance(self, req: Req, tokens: Sequence[int | None], logprobs: Sequence[float | None],
                top_logprobs: Sequence[list[tuple[float, int]] | None], grammar_status: str | None) -> int:
        before = len(req.output_ids)
        with self.boundary.guard(req, "processing its output"):
            accept(req, tokens, logprobs, top_logprobs, grammar_status, self.stop_checker)
        return len(req.output_ids) - before

    def stream_if_due(self, req: Req) -> None:
        """Queue `req`'s new tokens for the front end once stream_interval of them wait."""
        # Non-streamed requests too: the front end holds every token delivered, so it can
        # answer an abort at once with the output so far (it returns only the final result).
        if len(req.output_ids) - req.sent_len >= self.config.stream_interval:
            self.emit(req)

    def emit(self, req: Req) -> None:
        self._pending_out.append(make_output(req, include_input_logprobs=req.sent_len == 0))

    def flush(self) -> None:
        if self._pending_out:
            out, self._pending_out = self._pending_out, []
            self.send_output(BatchTokenOut(out))

    def forget_drafts(self) -> None:
        """flush_cache, weight updates and memory release: the n-gram index describes text of
        the old weights, and KV sessions hold is freed (never published: it may be old weights')."""
        self.sessions.drop_kv(insert=False)
        if self.speculation is not None:
            self.speculation.flush()
