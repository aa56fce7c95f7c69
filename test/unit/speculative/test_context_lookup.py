"""Prompt lookup against a brute-force reference, plus the cases the reference does not show."""
from __future__ import annotations

import random

import numpy as np
import pytest

from radixlm.speculative.context_lookup import (
    SuffixMatch,
    copy_continuation,
    longest_suffix_match,
)


def brute_force(ctx: list[int], lo: int, hi: int) -> SuffixMatch | None:
    n = len(ctx)
    for w in range(min(hi, n - 1), lo - 1, -1):
        for end in range(n - 1, w - 1, -1):
            if ctx[end - w:end] == ctx[n - w:]:
                return SuffixMatch(w, end)
    return None


@pytest.mark.parametrize("alphabet", [2, 3, 6])
def test_matches_brute_force_on_random_contexts(alphabet):
    rng = random.Random(alphabet)
    for _ in range(400):
        ctx = [rng.randrange(alphabet) for _ in range(rng.randrange(0, 40))]
        lo = rng.randrange(1, 4)
        hi = lo + rng.randrange(0, 6)
        assert longest_suffix_match(ctx, lo, hi) == brute_force(ctx, lo, hi), (ctx, lo, hi)


def test_longest_then_most_recent():
    #        0  1  2  3  4  5  6  7  8  9
    ctx = [7, 1, 2, 9, 3, 2, 8, 1, 2, 4, 1, 2]
    # "1 2" occurs ending at 3 and 9; "4 1 2" / "8 1 2" ... only "1 2" is shared: most recent wins.
    assert longest_suffix_match(ctx, 1, 5) == SuffixMatch(2, 9)
    ctx2 = [5, 1, 2, 0, 3, 3, 1, 2, 6, 5, 1, 2]
    # "5 1 2" ends at 3 (length 3) beats the later "1 2" ending at 8 (length 2).
    assert longest_suffix_match(ctx2, 1, 5) == SuffixMatch(3, 3)


def test_windows_bound_the_match():
    ctx = [1, 2, 3, 4, 9, 1, 2, 3, 4]
    assert longest_suffix_match(ctx, 1, 2) == SuffixMatch(2, 4)
    assert longest_suffix_match(ctx, 1, 12) == SuffixMatch(4, 4)
    # No match as long as min_window.
    assert longest_suffix_match([1, 2, 3, 9, 2, 3], 3, 5) is None
    assert longest_suffix_match([1, 2, 3, 9, 2, 3], 2, 5) == SuffixMatch(2, 3)


def test_short_and_invalid():
    assert longest_suffix_match([], 1, 4) is None
    assert longest_suffix_match([3], 1, 4) is None
    assert longest_suffix_match([3, 3], 1, 4) == SuffixMatch(1, 1)
    with pytest.raises(ValueError):
        longest_suffix_match([1, 2], 0, 3)
    with pytest.raises(ValueError):
        longest_suffix_match([1, 2], 3, 2)


def test_numpy_input_and_negative_ids():
    # Placeholder ids (negative) must not match tokens that ran past the start.
    ctx = np.array([-1, 5, -1, 5], dtype=np.int64)
    assert longest_suffix_match(ctx, 1, 4) == SuffixMatch(2, 2)
    assert longest_suffix_match(np.array([4, -1, -1]), 2, 4) is None


def test_copy_continuation_runs_into_the_draft_for_periodic_text():
    ctx = [1, 2, 3, 1, 2, 3, 1, 2]
    m = longest_suffix_match(ctx, 1, 12)
    assert m == SuffixMatch(5, 5)
    assert copy_continuation(ctx, m.end, 7) == [3, 1, 2, 3, 1, 2, 3]
    assert copy_continuation(ctx, 2, 3) == [3, 1, 2]
    assert copy_continuation(ctx, 7, 4) == [2, 2, 2, 2]
    assert copy_continuation(ctx, 0, 0) == []
    with pytest.raises(ValueError):
        copy_continuation(ctx, 8, 2)
