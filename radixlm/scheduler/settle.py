"""The one home of token acceptance and of settling a request after a forward.

Whoever ran the forward (a prefill batch, a decode step, a speculative verify step, the
decode server of prefill/decode disaggregation once a prompt's KV has arrived) hands the
tokens to `accept` (through `RequestOps.advance`, which adds the error boundary), then settles
the request: `settle_prefilled` for a request whose prompt is done (finish, or publish its
prompt in the prefix cache and start decoding), `settle_decoded` for the rows of a decode
step (stream those that go on, then finish those that ended). A change to the finish rules is
made here once.

The finish rules, in order, after each appended token: a pending abort (it drops the token),
max_new_tokens == 0 (no token at all), EOS / stop token ids / max_new_tokens
(`Req.check_finished`), the grammar's verdict on the run's last token, then stop strings and
stop regexes. The first token that finishes the request ends the run; the rest of it is never
delivered.
"""
from __future__ import annotations

import time
from collections.abc import Sequence

from radixlm.core import FinishReason, Req
from radixlm.scheduler.grammar_queue import grammar_finish
from radixlm.scheduler.output import StopStringChecker
from radixlm.scheduler.port import RequestOps
from radixlm.scheduler.requests import Place

__all__ = ["append_token", "accept", "settle_prefilled", "settle_decoded"]


def append_token(req: Req, token: int, logprob: float | None,
                 top: list[tuple[float, int]] | None) -> None:
    req.output_ids.append(token)
    if req.return_logprob:
        assert logprob is not None, f"{req.rid}: no logprob for a request that asked for them"
        req.output_token_logprobs.append((logprob, token))
        if req.keeps_top_lists:
            req.output_top_logprobs.append(top or [])


def accept(req: Req, tokens: Sequence[int | None], logprobs: Sequence[float | None],
           top_logprobs: Sequence[list[tuple[float, int]] | None], grammar_status: str | None,
           stops: StopStringChecker) -> int:
    """`tokens` (one per decode step, the emitted run of a verify step) through the finish
    rules; returns how many were appended. `grammar_status` is the matcher's verdict after the
    whole run (it saw every token of it)."""
    if req.to_finish is not None:
        req.check_finished()  # consumes the pending abort; the tokens are dropped
        return 0
    if req.sampling_params.max_new_tokens == 0:
        req.finish_reason = FinishReason("length", length=0)
        return 0
    if req.first_token_time is None:
        req.first_token_time = time.perf_counter()
    for j, token in enumerate(tokens):
        assert token is not None, f"{req.rid}: no token sampled for a sampling row"
        append_token(req, token, logprobs[j], top_logprobs[j])
        req.check_finished()
        if grammar_status is not None and j == len(tokens) - 1:
            grammar_finish(req, grammar_status, token)
        stops.check(req)
        if req.finish_reason is not None:
            return j + 1
    return len(tokens)


def settle_prefilled(ops: RequestOps, req: Req) -> None:
    """A request whose prompt is computed (or received) and first token accepted: it ends
    here, or its prompt joins the prefix cache and it decodes from now on."""
    if req.finish_reason is not None:
        ops.finish(req, req.finish_reason)
        return
    ops.cache.cache_prefill(req)
    ops.place(req, Place.RUNNING)
    ops.stream_if_due(req)


def settle_decoded(ops: RequestOps, reqs: Sequence[Req]) -> None:
    """The rows of a decode (or verify) step, their tokens accepted and KV committed: those
    that go on stream what is due, then those that ended are finished (in row order)."""
    finished = []
    for req in reqs:
        if req.finish_reason is None:
            ops.stream_if_due(req)
        else:
            finished.append(req)
    for req in finished:
        assert req.finish_reason is not None
        ops.finish(req, req.finish_reason)
