"""N-gram drafter: up to `num_draft_tokens` draft ids per request, from its own context
(prompt lookup) or from the index of recent requests' sequences.

The scheduler (see README.md) calls `propose` once per decode step
per row and `on_finish` once per finished request; nothing here holds per-request state, so
abort and retraction have nothing to clean up in the drafter (the draft's KV slots are the
cache manager's business).

Which source wins: the longer match; on a tie the request's own context, because what the
request itself wrote is the better predictor of what it will write next.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from radixlm.speculative.context_lookup import copy_continuation, longest_suffix_match
from radixlm.speculative.ngram_index import NgramIndex

__all__ = ["Draft", "DrafterStats", "NgramConfig", "NgramDrafter"]


@dataclass(frozen=True)
class NgramConfig:
    """The flags of `--speculative-algorithm ngram` (names as SGLang's where it has them)."""

    # --speculative-num-draft-tokens: drafts verified per row per step (0 turns drafting off).
    num_draft_tokens: int = 8
    # --speculative-ngram-min/max-match-window-size: suffix lengths tried, longest first.
    min_match_window: int = 1
    max_match_window: int = 12
    # --speculative-ngram-capacity: entries of the cross-request index (0: own context only).
    # An entry is ~180 B (benchmark/micro/ngram_acceptance.py prints the measured size): 2^18 ~ 48 MB.
    capacity: int = 1 << 18

    def __post_init__(self) -> None:
        if self.num_draft_tokens < 0:
            raise ValueError(f"speculative_num_draft_tokens must be >= 0, got {self.num_draft_tokens}")
        if not 1 <= self.min_match_window <= self.max_match_window:
            raise ValueError("need 1 <= speculative_ngram_min_match_window_size <= "
                             f"speculative_ngram_max_match_window_size, got {self.min_match_window}, "
                             f"{self.max_match_window}")
        if self.capacity < 0:
            raise ValueError(f"speculative_ngram_capacity must be >= 0, got {self.capacity}")


@dataclass(frozen=True)
class Draft:
    """Draft ids for one row; `source` is "context", "index" or "" (no draft)."""

    tokens: list[int] = field(default_factory=list)
    source: str = ""
    match_length: int = 0


@dataclass
class DrafterStats:
    proposals: int = 0
    from_context: int = 0
    from_index: int = 0
    empty: int = 0
    drafted_tokens: int = 0


class NgramDrafter:
    def __init__(self, config: NgramConfig):
        self.config = config
        self.index = NgramIndex(config.capacity, config.min_match_window, config.max_match_window,
                                branch_length=max(1, config.num_draft_tokens))
        self.stats = DrafterStats()

    def propose(self, context: Sequence[int], max_tokens: int | None = None) -> Draft:
        """Draft continuation of `context` (prompt + output ids so far), at most
        min(num_draft_tokens, max_tokens) ids.

        max_tokens lets the caller cap a draft at what the request may still produce
        (max_new_tokens left) or what the adaptive policy allows this step.
        """
        cfg = self.config
        k = cfg.num_draft_tokens if max_tokens is None else min(cfg.num_draft_tokens, max_tokens)
        self.stats.proposals += 1
        if k <= 0 or len(context) < 2:
            self.stats.empty += 1
            return Draft()
        ctx = np.asarray(context, dtype=np.int64)
        own = longest_suffix_match(ctx, cfg.min_match_window, cfg.max_match_window)
        # The index only matters if it can beat the own match: skip the lookup when the own
        # match already has the longest length the index could give.
        other = None
        if len(self.index) and (own is None or own.length < cfg.max_match_window):
            other = self.index.lookup(context)
        if own is not None and (other is None or own.length >= other.length):
            self.stats.from_context += 1
            return self._count(Draft(copy_continuation(ctx, own.end, k), "context", own.length))
        if other is not None:
            self.stats.from_index += 1
            return self._count(Draft(list(other.continuation[:k]), "index", other.length))
        self.stats.empty += 1
        return Draft()

    def on_finish(self, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        """Index a finished request's output, with the prompt's last max_match_window tokens
        as left context of the output's first n-grams.

        The rest of the prompt is not indexed: a request that sends the same prompt again
        finds it by prompt lookup, and indexing long prompts would cost the scheduler
        milliseconds per finish. Called for every request that produced output, aborted ones
        included: what it wrote predicts as well as a finished one's.
        """
        if self.config.capacity == 0 or not output_ids:
            return
        w = self.config.max_match_window
        tail = list(prompt_ids[max(0, len(prompt_ids) - w):])
        # Keys end inside the output or at its start: n-grams wholly inside the prompt tail
        # belong to the prompt, which this index leaves out.
        self.index.insert(tail + list(output_ids), first_key_end=len(tail))

    def flush(self) -> None:
        """Drop the index (weight update, flush_cache)."""
        self.index.flush()

    def _count(self, draft: Draft) -> Draft:
        self.stats.drafted_tokens += len(draft.tokens)
        return draft
