"""The scheduler's per-request error boundary: whatever fails for one request ends that
request (an abort with status 500) and leaves the batch, the other requests and the process
running (docs/error_boundary.md).

Three kinds of failure, three places:
- one request's own work (taking it in, admitting it to a prefill batch, processing its
  sampled token): `guard()` / `admit()` / `reject()` catch it and end that request;
- a forward (model, sampling, grammar mask) raises for the whole batch: nobody knows which
  row caused it, so `replay()` runs every request of the batch again *alone*. A request
  that fails alone is ended; the others get their own row's result, as if nothing happened
  (a forward writes the same KV slots with the same values, so the second run overwrites
  whatever the first left half-written);
- under overlap scheduling, the batch launched after a failed one may have read the failed
  batch's device tokens, so it is replayed too, and the loop syncs before building the
  next batch (`must_sync`), which ends the chain.

KV written by a failed forward is never published in the prefix cache (`CacheManager.poison`:
its release frees it instead of inserting it).
"""
from __future__ import annotations

import logging
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from radixlm.core import FinishReason, Req
from radixlm.sampling_params import SamplingParams
from radixlm.scheduler.batch import BatchResult, ModelRunnerProtocol, WorkerBatch
from radixlm.scheduler.port import RequestOps
from radixlm.scheduler.prefill import AddStatus, PrefillAdder
from radixlm.scheduler.requests import Place

if TYPE_CHECKING:
    from radixlm.messages import TokenizedGenerateReq
    from radixlm.scheduler.overlap import InFlight

logger = logging.getLogger(__name__)

__all__ = ["ErrorBoundary"]


def _reason(stage: str, exc: BaseException) -> FinishReason:
    text = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
    detail = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return FinishReason.abort(f"internal error while {stage} ({detail})", status_code=500)


class ErrorBoundary:
    def __init__(self, ops: RequestOps, runner: ModelRunnerProtocol) -> None:
        self.ops = ops
        self.runner = runner  # replays run a batch's rows one by one
        # overlap: the launched batch that must be replayed (it may have read a failed batch's tokens)
        self._replay_next: InFlight | None = None

    # ------------------------------------------------------------------ one request
    def _log(self, req_rid: str, stage: str, exc: BaseException) -> None:
        self.ops.stats.num_request_errors += 1
        logger.error("request %s failed while %s; ending it alone:\n%s", req_rid, stage,
                     "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))

    @contextmanager
    def guard(self, req: Req, stage: str) -> Iterator[None]:
        """Around one request's share of result processing: on an exception the request is
        marked finished with a 500 abort, and the caller's normal finish path releases it."""
        try:
            yield
        except Exception as e:  # noqa: BLE001 - the boundary's purpose
            self._log(req.rid, stage, e)
            req.finish_reason = _reason(stage, e)
            self.ops.cache.poison(req)

    def reject(self, msg: TokenizedGenerateReq, exc: BaseException) -> None:
        """A new request the scheduler could not take in: answer it (500), wherever it got to."""
        self._log(msg.rid, "being admitted", exc)
        ops = self.ops
        reason = _reason("being admitted", exc)
        held = ops.find(lambda r: r.rid == msg.rid, Place.WAITING, Place.GRAMMAR)
        for req in held:
            ops.stop(req, reason)
        if not held:
            stub = Req(rid=msg.rid, origin_input_ids=[], sampling_params=SamplingParams())
            stub.finish_reason = reason
            ops.emit(stub)
        ops.flush()

    def admit(self, adder: PrefillAdder, req: Req) -> AddStatus:
        """adder.add_one_req(req); a request whose admission raises is taken out of the batch
        being built and ended, and admission goes on with the next one."""
        try:
            status, _ = adder.add_one_req(req)
            return status
        except Exception as e:  # noqa: BLE001
            self._log(req.rid, "being scheduled", e)
            plan = adder.plan
            if req in plan.reqs:
                i = plan.reqs.index(req)
                for column in (plan.reqs, plan.prefix_lens, plan.extend_lens, plan.out_locs, plan.sample):
                    del column[i]
                if plan.new_chunked_req is req:
                    plan.new_chunked_req = None
            self.ops.cache.poison(req)
            self.ops.finish(req, _reason("being scheduled", e), insert=False)
            return AddStatus.CONTINUE

    # ------------------------------------------------------------------ forwards
    @property
    def must_sync(self) -> bool:
        """Overlap: the batch in flight is to be replayed; process it before building another."""
        return self._replay_next is not None

    def resolve(self, launched: InFlight, next_launched: InFlight | None) -> BatchResult:
        """The result of a launched batch, or its replay row by row if it failed
        (`next_launched`: the batch launched after it, overlap only)."""
        if launched is self._replay_next:
            self._replay_next = None
            _settle(launched)
            return self.replay(launched.batch, None)
        try:
            return launched.result()
        except Exception as e:  # noqa: BLE001
            nxt = next_launched
            if nxt is not None and nxt is not launched:  # launched on this batch's tokens: let it end, then redo it
                _settle(nxt)
                self._replay_next = nxt
            return self.replay(launched.batch, e)

    def replay(self, batch: WorkerBatch, error: BaseException | None) -> BatchResult:
        """Run each request of `batch` alone; those that fail alone are ended (to_finish, a
        500 abort, consumed by the normal result processing), the others get their result."""
        self.ops.stats.num_batch_replays += 1
        if error is not None:
            logger.error("a %s batch of %d requests failed; running them one by one:\n%s", batch.mode,
                         len(batch.reqs), "".join(traceback.format_exception(type(error), error,
                                                                             error.__traceback__)))
        n = len(batch.reqs)
        out = BatchResult([None] * n, [None] * n, [None] * n, [None] * n, [None] * n,
                          [None] * n if batch.grammars is not None else None,
                          [None] * n if batch.drafts is not None else None)
        start = 0
        for i, req in enumerate(batch.reqs):
            lo, start = start, start + batch.extend_lens[i]
            if req.finished or req.to_finish is not None:
                continue  # its result is dropped anyway
            if batch.grammars_advanced and batch.grammars is not None and batch.grammars[i] is not None:
                # the matcher already took a token of the failed run: it cannot be run again
                self._fail_row(req, RuntimeError("its grammar had advanced when the batch failed"))
                continue
            try:
                self.ops.cache.before_forward()  # HiCache: the loads the row reads have landed
                res = self.runner.launch(_row(batch, i, lo), None).result()
            except Exception as e:  # noqa: BLE001
                self._fail_row(req, e)
                continue
            out.next_token_ids[i] = res.next_token_ids[0]
            out.logprobs[i] = res.logprobs[0]
            out.top_logprobs[i] = res.top_logprobs[0]
            out.input_logprobs[i] = res.input_logprobs[0]
            out.input_top_logprobs[i] = res.input_top_logprobs[0]
            if out.grammar_status is not None and res.grammar_status is not None:
                out.grammar_status[i] = res.grammar_status[0]
            if out.verified is not None and res.verified is not None:
                out.verified[i] = res.verified[0]
        return out

    def _fail_row(self, req: Req, exc: BaseException) -> None:
        self._log(req.rid, "computing its next token", exc)
        req.to_finish = _reason("computing its next token", exc)
        self.ops.cache.poison(req)


def _settle(launched: InFlight) -> None:
    """Wait until a launched batch is done with the model, whatever its outcome."""
    try:
        launched.result()
    except Exception:  # noqa: BLE001 - it is replayed; the replay reports
        pass


def _row(batch: WorkerBatch, i: int, lo: int) -> WorkerBatch:
    """Request i of `batch` as a batch of its own. A placeholder input (overlap) names the
    previous batch's token, which is the request's last output token by now."""
    req = batch.reqs[i]
    n = batch.extend_lens[i]
    ids = list(batch.input_ids[lo:lo + n])
    if batch.is_decode and ids and ids[0] < 0:
        ids = [req.output_ids[-1]]
    masks = batch.draft_bitmask[lo:lo + n] if batch.draft_bitmask is not None else None
    mask_rows = [r - lo for r in batch.draft_mask_rows if lo <= r < lo + n]
    return WorkerBatch(mode=batch.mode, reqs=[req], input_ids=ids, out_cache_loc=batch.out_cache_loc[lo:lo + n],
                       prefix_lens=[batch.prefix_lens[i]], extend_lens=[n], sample=[batch.sample[i]],
                       input_logprob_ranges=[batch.input_logprob_ranges[i]] if batch.input_logprob_ranges else [],
                       input_logprob_targets=[batch.input_logprob_targets[i]] if batch.input_logprob_targets
                       else [],
                       output_snapshots=[list(req.output_ids)] if batch.output_snapshots is not None else None,
                       grammars=[batch.grammars[i]] if batch.grammars is not None else None,
                       drafts=[batch.drafts[i]] if batch.drafts is not None else None,
                       draft_bitmask=masks if mask_rows else None, draft_mask_rows=mask_rows)
