"""The runner's half of a speculative step: forward every row's [last, *draft] as one short
extend, take the logits of all its positions, and accept or reject the drafts with the
non-speculative sampler (radixlm/speculative/acceptance.py), so greedy and seeded rows emit
what plain decoding would, with the same logprobs (docs/speculative.md).

On the cpu attention backend a short extend row is computed by the decode kernel, position by
position, over the same KV: its logits equal those of sequential decode steps bit for bit
(test_verify_forward.py). A batch whose rows all have empty drafts is run as a plain decode.
Grammar rows come with one mask per verified position (filled by the scheduler, which checked
their drafts against the matcher); their matchers take the emitted run here, as a plain decode
row's matcher takes its token on the forward side.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from radixlm.core import Req
from radixlm.scheduler.batch import WorkerBatch
from radixlm.speculative.acceptance import verify_drafts
from radixlm.srt.constrained.bitmask import advance_matchers
from radixlm.srt.model_runner.forward_batch import ForwardBatch, ForwardMode
from radixlm.srt.model_runner.launched import LaunchedBatch
from radixlm.srt.model_runner.sampling_batch import SamplingRow, VocabMask

if TYPE_CHECKING:
    from radixlm.srt.model_runner.runner import ModelRunner

__all__ = ["advance_runs", "launch_verify", "sampling_row"]


def sampling_row(req: Req, output_ids: list[int]) -> SamplingRow:
    """What the sampler needs of one request (output_ids: as of before this step's token)."""
    sp = req.sampling_params
    stop_ids = frozenset(sp.stop_token_ids) | (frozenset() if sp.ignore_eos else req.eos_token_ids)
    return SamplingRow(params=sp, prompt_ids=req.origin_input_ids, output_ids=output_ids, stop_ids=stop_ids,
                       return_logprob=req.return_logprob, top_logprobs_num=req.top_logprobs_num,
                       token_ids_logprob=req.token_ids_logprob)


def launch_verify(runner: ModelRunner, batch: WorkerBatch) -> LaunchedBatch:
    assert batch.drafts is not None and batch.placeholder_source is None, "speculation runs without overlap"
    drafts = batch.drafts
    mode = ForwardMode.EXTEND if batch.has_drafts else ForwardMode.DECODE
    fb = ForwardBatch.build(mode, batch.input_ids, batch.out_cache_loc, [r.req_pool_idx for r in batch.reqs],
                            batch.prefix_lens, batch.extend_lens, runner.req_to_token, runner.device)
    start = runner.stream.mark()
    runner.attn.init_forward_metadata(fb)
    hidden = runner.model.forward(fb, runner.attn)
    logits = runner.model.compute_logits(hidden)  # every position is verified
    rows = [sampling_row(r, r.output_ids) for r in batch.reqs]
    ready: dict[str, Any] = {}
    vocab_mask = None
    if batch.draft_bitmask is not None:  # grammar rows: one mask per verified position (speculation.py)
        vocab_mask = VocabMask(batch.draft_bitmask.to(logits.device), batch.draft_mask_rows)
    verified = verify_drafts(runner.sampler, logits, rows, drafts, vocab_mask)
    if batch.grammars is not None:
        batch.grammars_advanced = True
        ready["grammar_status"] = advance_runs(batch.grammars, [v.tokens for v in verified])
    ready["verified"] = verified
    end = runner.stream.mark()
    tokens = torch.tensor([v.tokens[-1] for v in verified], dtype=torch.int64)
    return LaunchedBatch(batch, tokens, [], None, None, start, end, runner.stream, ready)


def advance_runs(matchers: list[Any], runs: list[list[int]]) -> list[str | None]:
    """Accept each grammar row's emitted tokens into its matcher, in order; the row's status as
    advance_matchers gives it for its last token ("rejected" / "error" at the first failure).
    The drafts were cut before any token that ends the grammar, so only the last may end it."""
    status: list[str | None] = []
    for m, run in zip(matchers, runs, strict=True):
        st: str | None = None
        for tok in run:
            (st,) = advance_matchers([m], [tok])
            if st is not None:
                break
        status.append(st)
    return status
