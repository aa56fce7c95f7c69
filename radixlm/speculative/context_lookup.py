"""Prompt lookup: draft tokens copied from the request's own context.

The context is prompt + output so far. Its suffix of length n (n in [min_window, max_window])
is searched for an earlier occurrence; the tokens that followed that occurrence are the draft.
The longest n wins; among equally long matches the most recent one wins, because text that is
being edited or quoted tends to repeat its nearest copy.

The search is one vectorised pass over a numpy view of the context plus one over the
surviving candidates (no per-request index to keep in sync or to free on the stop path): tens of
microseconds for a few thousand tokens, small next to a forward.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["SuffixMatch", "copy_continuation", "longest_suffix_match"]


@dataclass(frozen=True)
class SuffixMatch:
    """The context's last `length` tokens also end at `end` (exclusive, end < len(context))."""

    length: int
    end: int


def _as_array(context: Sequence[int] | np.ndarray) -> np.ndarray:
    if isinstance(context, np.ndarray):
        return context
    return np.fromiter(context, dtype=np.int64, count=len(context))


def longest_suffix_match(context: Sequence[int] | np.ndarray, min_window: int,
                         max_window: int) -> SuffixMatch | None:
    """The longest earlier occurrence of a suffix of `context` of length in [min_window,
    max_window] (capped at len(context) - 1), the most recent on ties; None if none.

    An occurrence ending at `end` must leave at least one token after it inside the context
    (end <= len - 1), so that it has a continuation; it may overlap the suffix itself, which is
    what finds periodic text ("abcabcab" matches "ab" ending at 5).
    """
    if min_window < 1 or max_window < min_window:
        raise ValueError(f"need 1 <= min_window <= max_window, got {min_window}, {max_window}")
    ctx = _as_array(context)
    n = int(ctx.shape[0])
    max_w = min(max_window, n - 1)
    if max_w < min_window:
        return None
    # Candidate ends e in [min_window, n - 1]: the occurrence is ctx[e - length : e]. One
    # vectorised pass finds the ends whose last token matches; the surviving candidates (few,
    # even for a common token) are then compared on all max_w tokens at once as a [C, max_w]
    # matrix: a fixed handful of numpy calls, where a loop over j would pay numpy's per-call
    # overhead max_w times.
    cand = np.flatnonzero(ctx[min_window - 1:n - 1] == ctx[n - 1]) + min_window  # ascending ends
    if cand.size == 0:
        return None
    back = np.arange(max_w)
    idx = cand[:, None] - 1 - back  # idx[c, j]: the token compared with ctx[n - 1 - j]
    eq = ctx[np.maximum(idx, 0)] == ctx[n - 1 - back]
    eq &= idx >= 0  # a candidate that ran past the start of the context stops there
    lengths = np.logical_and.accumulate(eq, axis=1).sum(axis=1)
    longest = int(lengths.max())
    if longest < min_window:
        return None
    return SuffixMatch(longest, int(cand[np.flatnonzero(lengths == longest)[-1]]))  # most recent on ties


def copy_continuation(context: Sequence[int] | np.ndarray, end: int, k: int) -> list[int]:
    """Up to k tokens that follow position `end` of context, continuing into the copy itself.

    When the match is close to the end of the context the copied run reaches the draft being
    built; copying on from there (as LZ77 does for an overlapping back-reference) extends a
    periodic context by its period instead of cutting the draft short.
    """
    ctx = _as_array(context)
    n = int(ctx.shape[0])
    if not 0 <= end < n:
        raise ValueError(f"end {end} outside a context of {n} tokens")
    period = n - end
    head = ctx[end:min(n, end + k)].tolist()
    return [head[i % period] if i >= period else head[i] for i in range(k)] if k > period else head
