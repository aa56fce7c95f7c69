"""Turning the scheduler's choice into the `WorkerBatch` the runner executes: a prefill plan's
chunks (with the prompt positions whose logprobs are wanted), or one decode step of the running
requests (with overlap's placeholders for tokens still being sampled)."""
from __future__ import annotations

from typing import Any

import torch

from radixlm.core import Req
from radixlm.scheduler.batch import WorkerBatch
from radixlm.scheduler.cache_manager import CacheManager
from radixlm.scheduler.overlap import placeholder
from radixlm.scheduler.prefill import PrefillBatchPlan

__all__ = ["prefill_batch", "decode_batch", "draft_batch", "input_logprob_range"]


def input_logprob_range(req: Req, prefix: int, extend: int) -> tuple[tuple[int, int], list[int]]:
    """Extend indices whose next-token logprobs are prompt logprobs for this request, and the
    prompt tokens they predict."""
    n_prompt = len(req.origin_input_ids)
    if not req.return_logprob or req.logprob_start_len < 0 or req.output_ids:
        return (0, 0), []
    # Position p's hidden state predicts token p + 1; prompt tokens from start need it.
    lo = max(req.logprob_start_len - 1, prefix) - prefix
    hi = min(n_prompt - 1, prefix + extend) - prefix
    if hi <= lo:
        return (0, 0), []
    return (lo, hi), req.origin_input_ids[prefix + lo + 1: prefix + hi + 1]


def _grammars(reqs: list[Req]) -> list[Any] | None:
    return [r.grammar for r in reqs] if any(r.grammar is not None for r in reqs) else None


def prefill_batch(plan: PrefillBatchPlan) -> WorkerBatch:
    input_ids: list[int] = []
    ranges: list[tuple[int, int]] = []
    targets: list[list[int]] = []
    for req, prefix, extend in zip(plan.reqs, plan.prefix_lens, plan.extend_lens, strict=True):
        input_ids.extend(req.fill_ids[prefix:prefix + extend])
        r, t = input_logprob_range(req, prefix, extend)
        ranges.append(r)
        targets.append(t)
    return WorkerBatch(mode="extend", reqs=plan.reqs, input_ids=input_ids, out_cache_loc=torch.cat(plan.out_locs),
                       prefix_lens=plan.prefix_lens, extend_lens=plan.extend_lens, sample=plan.sample,
                       input_logprob_ranges=ranges, input_logprob_targets=targets, grammars=_grammars(plan.reqs))


def decode_batch(reqs: list[Req], cache: CacheManager, launched: WorkerBatch | None, overlap: bool) -> WorkerBatch:
    """One more token for each of `reqs` (their decode room was made sure of). `launched`: the
    batch still running (overlap), whose rows name the tokens it is sampling."""
    src_rows = {id(r): i for i, r in enumerate(launched.reqs)} if launched is not None else {}
    locs = cache.extend_each(reqs)
    assert locs is not None, "decode memory was checked"
    input_ids, prefix_lens, snapshots = [], [], []
    for req in reqs:
        position = req.seqlen + req.pending_tokens - 1
        assert req.kv_allocated_len == position + 1, "decode slot out of step with the sequence"
        prefix_lens.append(position)
        # the newest token is still being sampled by the launched batch: name its row
        input_ids.append(placeholder(src_rows[id(req)]) if req.pending_tokens else req.output_ids[-1])
        if overlap:
            snapshots.append(req.output_ids + [input_ids[-1]] if req.pending_tokens else list(req.output_ids))
    n = len(reqs)
    return WorkerBatch(mode="decode", reqs=reqs, input_ids=input_ids, out_cache_loc=locs.clone(),
                       prefix_lens=prefix_lens, extend_lens=[1] * n, sample=[True] * n,
                       input_logprob_ranges=[(0, 0)] * n, input_logprob_targets=[[]] * n,
                       placeholder_source=id(launched) if any(r.pending_tokens for r in reqs) else None,
                       output_snapshots=snapshots if overlap else None, grammars=_grammars(reqs))


def draft_batch(reqs: list[Req], drafts: list[list[int]], cache: CacheManager) -> WorkerBatch:
    """One speculative step (no overlap): row i is the extend [last, *drafts[i]] after the
    request's KV. Every row's first slot was made sure of by the decode-room check; draft
    slots are opportunistic, so a draft that cannot get its slots now is dropped (the row
    decodes one token), never the cause of a retraction. All of a row's slots are inside its
    kv_allocated_len from here on, so every stop path frees them through release."""
    slots = cache.extend_each(reqs)
    assert slots is not None, "decode memory was checked"
    for req in reqs:
        assert req.kv_allocated_len == req.seqlen, "decode slot out of step with the sequence"
    firsts = slots.clone().split(1)
    kept: list[list[int]] = []
    locs, input_ids, prefix_lens, extend_lens = [], [], [], []
    for req, draft, first in zip(reqs, drafts, firsts, strict=True):
        more = cache.extend(req, len(draft)) if draft else None
        if more is None:
            draft = []
        kept.append(list(draft))
        locs.append(first if more is None else torch.cat([first, more]))
        input_ids += [req.output_ids[-1], *draft]
        prefix_lens.append(req.seqlen - 1)
        extend_lens.append(len(draft) + 1)
    n = len(reqs)
    return WorkerBatch(mode="decode", reqs=reqs, input_ids=input_ids, out_cache_loc=torch.cat(locs),
                       prefix_lens=prefix_lens, extend_lens=extend_lens, sample=[True] * n,
                       input_logprob_ranges=[(0, 0)] * n, input_logprob_targets=[[]] * n,
                       grammars=_grammars(reqs), drafts=kept)
