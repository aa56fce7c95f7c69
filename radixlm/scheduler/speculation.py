"""N-gram speculative decoding in the scheduler: drafting each decode step, and turning a
verified step into request progress with the one KV exit intact (docs/speculative.md).

A step: `drafts(reqs)` proposes per running row (own context + cross-request index, cut by the
adaptive rule and by the memory the step may use without retracting anyone); the batch builder
allocates the draft slots inside kv_allocated_len (`draft_batch`); the runner verifies; then
`process_result` feeds the emitted run through the one acceptance path (`RequestOps.advance`,
settle.py), commits the KV of what was kept and rolls the rest back in the same step. Between steps every
running request has kv_allocated_len == kv_committed_len: retraction, pause and abort never
meet a draft slot.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from radixlm.core import Req
from radixlm.scheduler.batch import BatchResult, WorkerBatch
from radixlm.scheduler.batch_builder import draft_batch
from radixlm.scheduler.cache_manager import CacheManager
from radixlm.scheduler.port import RequestOps, StepHooks
from radixlm.scheduler.settle import settle_decoded
from radixlm.speculative.adaptive import AcceptanceTracker, AdaptiveConfig
from radixlm.speculative.drafter import NgramConfig, NgramDrafter
from radixlm.speculative.grammar_drafts import constrain_draft
from radixlm.speculative.step_cost import StepCost, priced_ratios

__all__ = ["SpecState", "Speculation", "extra_token_cost"]

# One more verified token's cost relative to a decode step: a single stream's step is memory-bound
# (extra tokens are cheap but not free: the body's GEMMs and the LM head run k + 1 rows) and the
# step turns compute-bound as the batch grows (benchmark/micro/ngram_acceptance.py --measure-cost:
# 0.0-0.09 at batch 1, 0.15-0.64 at batch 32 on this 2-core machine under load). Linear in the
# batch from a floor, capped at 1: at batch 32 only drafts accepted ~80% of the time still pay.
# Where the runner measured this machine's forward times (Speculation.step_cost), the line is
# the floor of the price and the measurement decides above it.
COST_FLOOR = 0.05
COST_PER_ROW = 0.02


def extra_token_cost(batch_size: int) -> float:
    return min(1.0, COST_FLOOR + COST_PER_ROW * batch_size)


@dataclass
class SpecState:
    """One request's speculation: its acceptance estimate and counters (meta_info)."""

    tracker: AcceptanceTracker = field(default_factory=AcceptanceTracker)
    verify_ct: int = 0
    drafted: int = 0
    accepted: int = 0


@dataclass
class SpecStats:
    spec_verify_steps: int = 0  # speculative steps (batches)
    spec_verify_rows: int = 0  # request-steps verified
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_dropped_for_memory: int = 0  # draft tokens cut because the step had no room for them
    spec_cut_runs: int = 0  # verified runs a finish (EOS, stop string, length...) ended early
    spec_dropped_steps: int = 0  # rows whose step was dropped whole (ended while it ran)


class Speculation(StepHooks):
    """Built before the scheduler (with the step cost its process measured) and handed to it;
    a step hook for the index (on_finish) and server_info."""

    def __init__(self, config: NgramConfig, cache: CacheManager, max_context_len: int, vocab_size: int,
                 step_cost: StepCost | None = None) -> None:
        self.config = config
        self.drafter = NgramDrafter(config)
        self.adaptive = AdaptiveConfig()
        self.cache = cache
        self.max_context_len = max_context_len
        self.vocab_size = vocab_size
        self.stats = SpecStats()
        # Verify-step costs measured on this runner at start-up; None: the extra_token_cost line.
        self.step_cost = step_cost
        self._costs: dict[int, tuple[float, ...]] = {}  # batch size -> cost(0..num_draft_tokens)
        # this step's grammar rows: id(req) -> the masks of the draft's verified positions
        self._masks: dict[int, torch.Tensor] = {}

    # ---------------------------------------------------------------- before the forward
    @staticmethod
    def state(req: Req) -> SpecState:
        if req.spec is None:
            req.spec = SpecState()
        st: SpecState = req.spec
        return st

    def drafts(self, reqs: list[Req]) -> list[list[int]]:
        """Each row's draft for this step (possibly empty)."""
        max_k = self.drafter.config.num_draft_tokens
        cost = self._cost(len(reqs), max_k)
        out: list[list[int]] = []
        for req in reqs:
            st = self.state(req)
            room = max(0, min(req.sampling_params.max_new_tokens - len(req.output_ids) - 1,
                              self.max_context_len - req.seqlen - 1))
            # No draft would pay (low acceptance, or a batch where extra rows cost about a step
            # each): skip the lookup, whose answer would be cut to nothing anyway.
            if not st.tracker.may_draft(min(room, max_k), cost, self.adaptive):
                out.append([])
                continue
            draft = self.drafter.propose(req.fill_ids, max_tokens=room)
            k = st.tracker.draft_length(draft.match_length, len(draft.tokens), cost, self.adaptive)
            out.append(self._constrain(req, draft.tokens[:k]))
        return self._fit(out, len(reqs))

    def _cost(self, batch_size: int, max_k: int) -> float | tuple[float, ...]:
        """This step's cost(0..max_k) (step_cost.py), computed once per batch size (max_k is
        always num_draft_tokens; batch sizes are bounded by max_running_requests)."""
        line = extra_token_cost(batch_size)
        if self.step_cost is None:
            return line
        got = self._costs.get(batch_size)
        if got is None:
            got = self._costs[batch_size] = priced_ratios(self.step_cost, line, batch_size, max_k)
        return got

    def _constrain(self, req: Req, draft: list[int]) -> list[int]:
        """A grammar row's draft cut at the first token its grammar rejects (or before one that
        would end it), with the mask of every verified position; the matcher ends where it
        started, so no draft token advances the grammar (the forward side accepts what the step
        emits). Runs on the scheduler thread, which is the forward's: speculation has no overlap."""
        m = req.grammar
        if m is None or m.terminated:
            return draft
        scratch = torch.empty((len(draft) + 1, (self.vocab_size + 31) // 32), dtype=torch.int32)
        n = constrain_draft(m, draft, scratch, 0)
        self._masks[id(req)] = scratch[:n + 1]
        return draft[:n]

    def _fit(self, drafts: list[list[int]], num_rows: int) -> list[list[int]]:
        """Shorten drafts, longest first, until the step fits free + evictable memory beside
        each row's one decode slot: a draft never causes a retraction."""
        budget = self.cache.available() + self.cache.evictable() - num_rows
        over = sum(len(d) for d in drafts) - max(budget, 0)
        while over > 0:
            longest = max(range(len(drafts)), key=lambda i: len(drafts[i]))
            drafts[longest] = drafts[longest][:-1]
            self.stats.spec_dropped_for_memory += 1
            over -= 1
        return drafts

    def batch(self, reqs: list[Req]) -> WorkerBatch:
        self._masks.clear()
        batch = draft_batch(reqs, self.drafts(reqs), self.cache)
        if self._masks:
            self._place_masks(batch)
        return batch

    def _place_masks(self, batch: WorkerBatch) -> None:
        """The grammar rows' masks at their flat positions (a draft the memory cut shortened
        keeps the first masks: mask j is the grammar's state after d_1..d_j)."""
        assert batch.drafts is not None
        bitmask = torch.full((sum(len(d) + 1 for d in batch.drafts), (self.vocab_size + 31) // 32), -1,
                             dtype=torch.int32)
        start = 0
        for req, d in zip(batch.reqs, batch.drafts, strict=True):
            masks = self._masks.get(id(req))
            if masks is not None:
                bitmask[start:start + len(d) + 1] = masks[:len(d) + 1]
                batch.draft_mask_rows.extend(range(start, start + len(d) + 1))
            start += len(d) + 1
        batch.draft_bitmask = bitmask
        self._masks.clear()

    # ---------------------------------------------------------------- after the forward
    def process_result(self, ops: RequestOps, batch: WorkerBatch, result: BatchResult) -> None:
        assert batch.drafts is not None
        self.stats.spec_verify_steps += 1
        rows: list[Req] = []
        for i, req in enumerate(batch.reqs):
            if req.finished:
                continue
            k = len(batch.drafts[i])
            v = result.verified[i] if result.verified is not None else None
            if req.to_finish is not None or v is None:
                # Ended while the step ran (or its replay failed): nothing of this step is
                # delivered and none of its KV kept.
                self.cache.rollback(req, k + 1)
                req.check_finished()
                self.stats.spec_dropped_steps += 1
                rows.append(req)
                continue
            status = result.grammar_status[i] if result.grammar_status is not None else None
            # the matcher saw the whole run: its verdict is on the run's last token
            kept = ops.advance(req, v.tokens, v.logprobs, v.top_logprobs, status)
            self.stats.spec_cut_runs += kept < len(v.tokens)
            # The kept tokens' inputs (last, d_1..d_{kept-1}) hold KV now; the rest goes back.
            self.cache.commit(req, kept)
            self.cache.rollback(req, k + 1 - kept)
            self._count(req, k, v.truncated(kept).num_accepted if kept else 0)
            ops.stats.num_decode_tokens += max(kept - 1, 0)  # the step's row was counted once already
            rows.append(req)
        settle_decoded(ops, rows)

    def _count(self, req: Req, drafted: int, accepted: int) -> None:
        st = self.state(req)
        st.verify_ct += 1
        st.drafted += drafted
        st.accepted += accepted
        st.tracker.observe(drafted, min(accepted, drafted), self.adaptive)
        self.stats.spec_verify_rows += 1
        self.stats.spec_draft_tokens += drafted
        self.stats.spec_accepted_tokens += accepted

    # ---------------------------------------------------------------- index
    def on_finish(self, req: Req) -> None:
        """Every answered request with output feeds the cross-request index (aborts too)."""
        if req.output_ids:
            self.drafter.on_finish(req.origin_input_ids, req.output_ids)

    def flush(self) -> None:
        """flush_cache and weight updates: the index describes text of the old weights."""
        self.drafter.flush()

    def info(self) -> dict[str, Any]:
        st = self.stats
        rate = st.spec_accepted_tokens / st.spec_draft_tokens if st.spec_draft_tokens else 0.0
        length = 1 + st.spec_accepted_tokens / st.spec_verify_rows if st.spec_verify_rows else 0.0
        return {"speculative_algorithm": "ngram", **vars(st), "spec_accept_rate": round(rate, 4),
                "spec_accept_length": round(length, 4), "spec_index_entries": len(self.drafter.index),
                "spec_step_cost": self.step_cost.as_dict() if self.step_cost is not None else None}
