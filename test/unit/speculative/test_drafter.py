"""NgramDrafter: which source a draft comes from, its length caps, indexing on finish."""
from __future__ import annotations

import pytest

from radixlm.speculative.drafter import Draft, NgramConfig, NgramDrafter


def drafter(**kw) -> NgramDrafter:
    return NgramDrafter(NgramConfig(**({"num_draft_tokens": 4} | kw)))


def test_prompt_lookup_drafts_the_copy():
    d = drafter()
    ctx = [10, 11, 12, 13, 14, 15, 99, 10, 11]
    assert d.propose(ctx) == Draft([12, 13, 14, 15], "context", 2)
    assert d.propose(ctx, max_tokens=2) == Draft([12, 13], "context", 2)
    assert d.stats.from_context == 2 and d.stats.drafted_tokens == 6


def test_no_draft_cases():
    d = drafter()
    assert d.propose([1, 2, 3, 4]) == Draft()  # nothing repeats, index empty
    assert d.propose([5]) == Draft()
    assert d.propose([5, 5, 5], max_tokens=0) == Draft()
    assert drafter(num_draft_tokens=0).propose([5, 5, 5]) == Draft()
    assert d.stats.empty == 3


def test_index_drafts_from_a_finished_request():
    d = drafter()
    d.on_finish([1, 2, 3], [40, 41, 42, 43, 44, 45])
    # A new request whose output starts like the finished one's.
    assert d.propose([7, 8, 9, 40, 41]) == Draft([42, 43, 44, 45], "index", 2)
    assert d.stats.from_index == 1
    # The prompt is not indexed (only its tail as left context of the output's first keys).
    assert d.propose([0, 0, 1, 2]) == Draft()
    assert d.propose([6, 6, 2, 3]) == Draft([40, 41, 42, 43], "index", 2)


def test_longer_match_wins_and_ties_go_to_the_own_context():
    d = drafter()
    d.on_finish([], [1, 2, 3, 50, 51, 52, 53])
    # Own context has "2 3" -> 60 ..., the index has "1 2 3" -> 50 ...: the index is longer.
    assert d.propose([2, 3, 60, 61, 62, 63, 1, 2, 3]).source == "index"
    # Same length (2) in both: own context.
    assert d.propose([2, 3, 60, 61, 62, 63, 9, 2, 3]) == Draft([60, 61, 62, 63], "context", 2)


def test_flush_and_zero_capacity():
    d = drafter()
    d.on_finish([], [1, 2, 3, 4])
    d.flush()
    assert d.propose([0, 1, 2]) == Draft()
    z = drafter(capacity=0)
    z.on_finish([], [1, 2, 3, 4])
    assert len(z.index) == 0 and z.propose([0, 1, 2]) == Draft()


def test_only_the_prompt_tail_is_indexed():
    d = drafter(max_match_window=3)
    d.on_finish(list(range(1000)), [7, 8])
    # Keys end at the output's first token (3 keys: 999 / 998 999 / 997 998 999) or its second.
    assert len(d.index) == 3 + 3
    assert d.propose([5, 997, 998, 999]) == Draft([7, 8], "index", 3)
    assert d.propose([5, 995, 996]) == Draft()


def test_config_validation():
    for bad in ({"num_draft_tokens": -1}, {"min_match_window": 0}, {"min_match_window": 5, "max_match_window": 4},
                {"capacity": -1}):
        with pytest.raises(ValueError):
            NgramConfig(**bad)
