"""Verify draft tokens against the target model's logits, keeping the output distribution.

A row with drafts d_1..d_K is forwarded as the short extend [last_token, d_1, ..., d_K]: K + 1
positions, position j predicting the token after d_j (d_0 = last_token). For each row this
module returns the tokens the step emits: the accepted drafts and then one token of the
target's own (the correction at the first rejection, or the bonus after K acceptances).

How, for both greedy and sampled rows: the target draws its token t_j at every position with
the non-speculative sampler itself, the row's output ids extended by d_1..d_{j-1} (so
penalties, min_new_tokens and the per-output-index seed are those the sampler would see
without speculation), and d_j is accepted while t_j == d_j. The first mismatch emits t_j.

This *is* rejection sampling for a deterministic (point-mass) draft, coupled through the
sampler's one uniform per position: with p the target distribution at position j (after
temperature, top-k/top-p/min-p, penalties, bias, grammar),
    P(accept d_j)            = P(t_j = d_j) = p(d_j)
    P(emit y | rejected)     = p(y) / (1 - p(d_j)) for y != d_j, 0 for y = d_j
which is "accept d with probability p(d), else sample from p with d removed, renormalised".
The coupling buys two things an independent accept coin would not: a greedy row gets the
longest prefix matching the argmax chain, and a seeded row emits exactly the tokens the
non-speculative sampler would for the same logits (same u per output index). Logprobs (and top
logprobs) of every emitted token are the sampler's, so they equal non-speculative ones too.

Extra positions are drawn past a rejection and thrown away; for unseeded rows that only
advances the sampler's generator, which has no reproducibility promise across batches anyway.

This module imports nothing from radixlm: the sampler and its rows come in through the
Protocols below, so the speculative package stays below srt in the layering.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

__all__ = ["RowSampler", "Verified", "verification_rows", "verify_drafts"]


class SampleResult(Protocol):
    next_token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[float, int]] | None]


class RowSampler(Protocol):
    """radixlm.srt.model_runner.sampler.Sampler, as far as verification uses it."""

    def sample(self, logits: torch.Tensor, rows: list[Any], vocab_mask: Any = None) -> SampleResult: ...


@dataclass
class Verified:
    """One row's result: `tokens` = accepted drafts + one target token (always >= 1)."""

    tokens: list[int]
    num_drafted: int
    logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[list[tuple[float, int]] | None] = field(default_factory=list)

    @property
    def num_accepted(self) -> int:
        """Drafts accepted (the last emitted token is the target's own, not a draft)."""
        return min(len(self.tokens) - 1, self.num_drafted) if self.tokens else 0

    @property
    def kv_keep(self) -> int:
        """How many of this step's num_drafted + 1 KV slots hold committed tokens.

        Position j's slot holds the KV of its input token (last_token, then d_1, ...). After
        emitting n tokens the inputs last_token, d_1..d_{n-1} are part of the sequence; the
        n-th emitted token has no KV yet (it is the next step's input). So the first n slots
        are kept, the other num_drafted + 1 - n go back to the allocator in this step.
        """
        return len(self.tokens)

    def truncated(self, n: int) -> Verified:
        """The first n emitted tokens (a stop token, stop string or max_new_tokens inside the
        accepted run ends the request there; the rest of the run is never delivered)."""
        if not 1 <= n <= len(self.tokens):
            raise ValueError(f"cannot keep {n} of {len(self.tokens)} emitted tokens")
        return Verified(self.tokens[:n], self.num_drafted, self.logprobs[:n], self.top_logprobs[:n])


def verification_rows(row: Any, draft: Sequence[int]) -> list[Any]:
    """The sampler rows of one verified row: position j sees output_ids + draft[:j].

    `row` is a SamplingRow (any dataclass with `output_ids`); copies share everything else.
    """
    base = list(row.output_ids)
    return [row if j == 0 else dataclasses.replace(row, output_ids=base + list(draft[:j]))
            for j in range(len(draft) + 1)]


def verify_drafts(sampler: RowSampler, logits: torch.Tensor, rows: Sequence[Any],
                  drafts: Sequence[Sequence[int]], vocab_mask: Any = None) -> list[Verified]:
    """Accept or reject each row's drafts in one sampler call.

    logits: [sum(len(d) + 1 for d in drafts), >= V], row-major: row i's len(drafts[i]) + 1
    positions are consecutive, in order. rows[i] is row i's SamplingRow as of before this step.
    vocab_mask, if given, covers the flattened positions (a grammar row's mask at position j
    must be the matcher's state after d_1..d_{j-1}; the caller checks drafts against the
    grammar first and cuts them at the first token it rejects).
    """
    if len(rows) != len(drafts):
        raise ValueError(f"{len(rows)} rows but {len(drafts)} drafts")
    flat: list[Any] = []
    for row, draft in zip(rows, drafts, strict=True):
        flat.extend(verification_rows(row, draft))
    if logits.shape[0] != len(flat):
        raise ValueError(f"logits have {logits.shape[0]} rows, the drafts need {len(flat)}")
    if not flat:
        return []
    out = sampler.sample(logits, flat, vocab_mask)
    results: list[Verified] = []
    start = 0
    for draft in drafts:
        k = len(draft)
        target = out.next_token_ids[start:start + k + 1]
        n = 0
        while n < k and target[n] == draft[n]:
            n += 1
        # n drafts accepted; position n's token is the correction (n < k) or the bonus.
        sl = slice(start, start + n + 1)
        results.append(Verified(list(target[:n + 1]), k, list(out.logprobs[sl]), list(out.top_logprobs[sl])))
        start += k + 1
    return results
