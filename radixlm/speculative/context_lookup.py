"""Prompt lookup: draft tokens copied from the request's own context.

The context is prompt + output so far. Its suffix of length n (n in [min_window, max_window])
is searched for an earlier occurrence; the tokens that followed that occurrence are the draft.
The longest n wins; among equally long matches the most recent one wins, because text that is
being edited or quoted tends to repeat its nearest copy.

The search is one vectorised pass per window size over a numpy view of the context (no
per-request index to keep in sync or to free on the stop path): a few dozen microseconds for a
few thousand tokens, small next to a forward.
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
    # Candidate ends e in [min_window, n - 1]: the occurrence is ctx[e - length : e].
    # alive[i] says the candidate with end = min_window + i still matches the j tokens tested.
    lo = min_window
    alive = np.ones(n - lo, dtype=bool)
    best: SuffixMatch | None = None
    for j in range(max_w):
        # Candidates with end e compare ctx[e - 1 - j] with ctx[n - 1 - j]; those with
        # e - 1 - j < 0 have run out of tokens and die.
        start = lo - 1 - j  # index compared for the first candidate (end = lo)
        if start >= 0:
            alive &= ctx[start:start + n - lo] == ctx[n - 1 - j]
        else:
            # The first -start candidates ran past the start of the context: they die (a
            # sentinel value could collide with a placeholder id, a mask cannot).
            alive[:-start] = False
            alive[-start:] &= ctx[0:n - lo + start] == ctx[n - 1 - j]
        if not alive.any():
            break
        if j + 1 >= min_window:
            e = lo + int(np.flatnonzero(alive)[-1])
            best = SuffixMatch(j + 1, e)
    return best


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
