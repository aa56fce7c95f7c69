"""Stop strings, the outgoing message of a request, and prompt logprobs (token acceptance is settle.py)."""
from __future__ import annotations

from typing import Protocol

from radixlm.core import FinishReason, Req
from radixlm.messages import DetokParams, ReqOutput
from radixlm.scheduler.batch import BatchResult
from radixlm.stop_regex import first_match, max_match_chars


class Tokenizer(Protocol):
    """What the scheduler decodes stop strings with (a Hugging Face tokenizer)."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str: ...


class StopStringChecker:
    """Finds stop strings and stop regexes in the decoded tail of a request's output.

    Checked after every token, so a match can only end in the newest token; decoding the
    last len(stop) + 8 tokens covers it (a token decodes to at least one byte; the extra
    tokens cover multi-byte characters split across tokens). A regex with a bounded match
    length gets the same window over its bound; an unbounded one sees the whole output."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer

    def check(self, req: Req) -> None:
        sp = req.sampling_params
        stops, regexes = sp.stop, sp.stop_regex
        if not (stops or regexes) or req.finished or self.tokenizer is None:
            return
        if len(req.output_ids) < sp.min_new_tokens:
            return
        widths = [len(s) for s in stops] + [max_match_chars(p) for p in regexes]
        bounded = [w for w in widths if w is not None]
        window = max(bounded) + 8 if len(bounded) == len(widths) else None
        tail = self.tokenizer.decode(req.output_ids if window is None else req.output_ids[-window:],
                                     skip_special_tokens=False)
        for s in stops:
            if s in tail:
                req.finish_reason = FinishReason("stop", matched=s)
                return
        if regexes:
            try:
                hit = first_match(regexes, tail)
            except TimeoutError:
                req.finish_reason = FinishReason.abort("a stop_regex pattern took too long to match",
                                                       status_code=400)
                return
            if hit is not None:
                req.finish_reason = FinishReason("stop", matched=hit[2])  # the pattern, as SGLang reports it


def make_output(req: Req, include_input_logprobs: bool) -> ReqOutput:
    start = req.sent_len
    out = ReqOutput(
        rid=req.rid,
        new_token_ids=req.output_ids[start:],
        finish_reason=req.finish_reason.to_dict() if req.finish_reason else None,
        prompt_tokens=len(req.origin_input_ids),
        completion_tokens=len(req.output_ids),
        cached_tokens=req.cached_tokens,
        num_retractions=req.num_retractions,
    )
    if req.spec is not None:
        out.spec_verify_ct = req.spec.verify_ct
        out.spec_draft_tokens = req.spec.drafted
        out.spec_accepted_tokens = req.spec.accepted
    if start == 0 and not req.detok_sent:
        sp = req.sampling_params
        out.detok = DetokParams(tuple(sp.stop), sp.skip_special_tokens, sp.spaces_between_special_tokens,
                                sp.no_stop_trim, tuple(sp.stop_regex), text_at_end=not req.stream)
        req.detok_sent = True
    if req.return_logprob:
        out.output_token_logprobs = req.output_token_logprobs[start:]
        out.output_top_logprobs = req.output_top_logprobs[start:]
        if include_input_logprobs:
            out.input_token_logprobs = list(req.input_token_logprobs)
            out.input_top_logprobs = list(req.input_top_logprobs)
    req.sent_len = len(req.output_ids)
    return out


def record_input_logprobs(req: Req, targets: list[int], result: BatchResult, i: int) -> None:
    """The prompt logprobs row i of a prefill chunk computed for `req` (position 0 has none)."""
    lps = result.input_logprobs[i] or []
    tops = result.input_top_logprobs[i] or []
    if not req.input_token_logprobs and req.logprob_start_len == 0:
        req.input_token_logprobs.append((None, req.origin_input_ids[0]))
        if req.keeps_top_lists:
            req.input_top_logprobs.append(None)
    for j, (lp, tok) in enumerate(zip(lps, targets, strict=True)):
        req.input_token_logprobs.append((lp, tok))
        if req.keeps_top_lists:
            req.input_top_logprobs.append(tops[j])
