"""Drafts of structured-output rows: cut at the grammar, one mask per verified position.

A grammar row's draft is walked through its matcher before the forward: the draft is cut at
the first token the grammar rejects, and the allowed-token bitmask is filled for every position
that will be verified (position j's mask is the matcher's state after d_1..d_j). Then the
matcher is rolled back, so no draft token, accepted later or not, has advanced the grammar; the
scheduler accepts the emitted tokens into it after verification, as it does for a plain decode
token. The sampler applies these masks like any grammar mask, so a correction or bonus token
also obeys the grammar.

A draft also stops before a token that would terminate the matcher (a stop token): there is no
mask after termination, and the target can emit that token itself at the next position.

The matcher is duck-typed (`DraftMatcher`): radixlm's XGrammarMatcher plus a `rollback(n)`
that forwards to xgrammar's GrammarMatcher.rollback (unlimited rollback in xgrammar >= 0.1.2x).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

__all__ = ["DraftMatcher", "GrammarDrafts", "constrain_draft", "constrain_drafts"]


class DraftMatcher(Protocol):
    @property
    def terminated(self) -> bool: ...

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None: ...

    def accept(self, token: int) -> bool: ...

    def rollback(self, num_tokens: int) -> None: ...


def constrain_draft(matcher: DraftMatcher, draft: Sequence[int], bitmask: torch.Tensor, first_row: int) -> int:
    """How many of `draft` the grammar allows in a row (n); fills bitmask rows first_row ..
    first_row + n (the n + 1 verified positions). The matcher ends where it started."""
    n = 0
    matcher.fill_bitmask(bitmask, first_row)
    for token in draft:
        if not matcher.accept(int(token)):
            break
        n += 1
        if matcher.terminated:
            matcher.rollback(1)  # see the module docstring: stop before a terminating token
            n -= 1
            break
        matcher.fill_bitmask(bitmask, first_row + n)
    if n:
        matcher.rollback(n)
    return n


@dataclass
class GrammarDrafts:
    """The batch's drafts cut at their grammars, and the bitmask of every verified position.

    `bitmask` is int32 [sum(len(d) + 1), ceil(V / 32)] in the flattened position order of
    verify_drafts (None: no grammar row); `rows` lists the masked positions (those of grammar
    rows). The runner wraps them as its VocabMask(bitmask, rows).
    """

    drafts: list[list[int]]
    bitmask: torch.Tensor | None
    rows: list[int]


def constrain_drafts(matchers: Sequence[DraftMatcher | None], drafts: Sequence[Sequence[int]],
                     vocab_size: int) -> GrammarDrafts:
    """constrain_draft for every row with a matcher; rows without one keep their draft.

    A terminated matcher (its request finishes this step) gets no mask and no draft.
    """
    import torch

    if len(matchers) != len(drafts):
        raise ValueError(f"{len(matchers)} matchers but {len(drafts)} drafts")
    out = [list(d) for d in drafts]
    if all(m is None for m in matchers):
        return GrammarDrafts(out, None, [])
    # Each grammar row's masks go to a scratch block first: the final layout depends on the
    # cut lengths, known only once every row has been walked.
    width = (vocab_size + 31) // 32
    scratch = torch.zeros((max(len(d) for d in out) + 1, width), dtype=torch.int32)
    kept: list[torch.Tensor | None] = []
    for i, m in enumerate(matchers):
        if m is None:
            kept.append(None)
            continue
        if m.terminated:
            out[i] = []
            kept.append(None)
            continue
        n = constrain_draft(m, out[i], scratch, 0)
        out[i] = out[i][:n]
        kept.append(scratch[:n + 1].clone())
    bitmask = torch.full((sum(len(d) + 1 for d in out), width), -1, dtype=torch.int32)  # -1: all allowed
    rows: list[int] = []
    start = 0
    for d, masks in zip(out, kept, strict=True):
        if masks is not None:
            bitmask[start:start + len(d) + 1] = masks
            rows.extend(range(start, start + len(d) + 1))
        start += len(d) + 1
    return GrammarDrafts(out, bitmask, rows)
