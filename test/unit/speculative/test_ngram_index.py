"""The cross-request n-gram index: longest match, LRU order, the capacity bound, flush."""
from __future__ import annotations

import random

import pytest

from radixlm.speculative.ngram_index import IndexMatch, NgramIndex


def test_lookup_prefers_the_longest_key():
    idx = NgramIndex(capacity=1000, min_window=1, max_window=3, branch_length=3)
    idx.insert([1, 2, 3, 4, 5, 6])
    idx.insert([9, 3, 7, 7])  # "3" now continues with 7 7, but "2 3" still with 4 5 6
    assert idx.lookup([0, 2, 3]) == IndexMatch(2, (4, 5, 6))
    assert idx.lookup([0, 8, 3]) == IndexMatch(1, (7, 7))
    assert idx.lookup([1, 2, 3]) == IndexMatch(3, (4, 5, 6))
    assert idx.lookup([0, 0, 42]) is None
    assert idx.stats.hits == 3 and idx.stats.lookups == 4


def test_continuation_is_cut_at_branch_length_and_at_the_end():
    idx = NgramIndex(capacity=1000, min_window=2, max_window=2, branch_length=2)
    idx.insert([1, 2, 3, 4, 5])
    assert idx.lookup([1, 2]) == IndexMatch(2, (3, 4))
    assert idx.lookup([3, 4]) == IndexMatch(2, (5,))
    assert idx.lookup([4, 5]) is None  # no continuation: never indexed
    assert len(idx) == 3  # (1,2) (2,3) (3,4)


def test_first_key_end_skips_left_context():
    idx = NgramIndex(capacity=1000, min_window=1, max_window=2, branch_length=4)
    idx.insert([1, 2, 3, 4], first_key_end=2)
    assert idx.lookup([1]) is None  # key ending at 1 < first_key_end
    assert idx.lookup([1, 2]) == IndexMatch(2, (3, 4))
    assert idx.lookup([3]) == IndexMatch(1, (4,))


def test_capacity_holds_during_an_insert_and_evicts_least_recently_used():
    idx = NgramIndex(capacity=4, min_window=1, max_window=1, branch_length=1)
    idx.insert([10, 11, 12, 13, 14, 15, 16])  # six keys 10..15
    assert len(idx) == 4 and idx.stats.evicted_entries == 2
    assert idx.lookup([10]) is None and idx.lookup([11]) is None
    assert idx.lookup([12]) == IndexMatch(1, (13,))  # a hit makes 12 the most recent
    idx.insert([20, 21])  # evicts the oldest: 13
    assert idx.lookup([13]) is None
    assert idx.lookup([12]) is not None and idx.lookup([14]) is not None

    # Against a reference LRU (a list, most recent last) on random sequences.
    big = NgramIndex(capacity=50, min_window=1, max_window=4, branch_length=3)
    ref: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    rng = random.Random(0)
    for _ in range(20):
        seq = [rng.randrange(30) for _ in range(60)]
        big.insert(seq)
        for end in range(1, len(seq)):
            for w in range(1, min(4, end) + 1):
                key = tuple(seq[end - w:end])
                ref = [kv for kv in ref if kv[0] != key] + [(key, tuple(seq[end:end + 3]))]
                ref = ref[-50:]
        assert len(big) <= 50
        assert list(big._map.items()) == ref


def test_reinsert_refreshes_and_overwrites():
    idx = NgramIndex(capacity=2, min_window=1, max_window=1, branch_length=1)
    idx.insert([1, 2])
    idx.insert([3, 4])
    idx.insert([1, 5])  # refreshes key 1 (now -> 5): key 3 is the oldest
    idx.insert([6, 7])
    assert idx.lookup([1]) == IndexMatch(1, (5,))
    assert idx.lookup([3]) is None


def test_zero_capacity_flush_and_validation():
    idx = NgramIndex(capacity=0, min_window=1, max_window=2, branch_length=2)
    idx.insert([1, 2, 3])
    assert len(idx) == 0 and idx.lookup([1, 2]) is None
    idx = NgramIndex(capacity=10, min_window=1, max_window=2, branch_length=2)
    idx.insert([1, 2, 3])
    idx.flush()
    assert len(idx) == 0 and idx.lookup([1]) is None and idx.stats.flushes == 1
    for bad in ({"capacity": -1}, {"min_window": 0}, {"max_window": 0}, {"branch_length": 0}):
        kw = {"capacity": 1, "min_window": 1, "max_window": 2, "branch_length": 2} | bad
        with pytest.raises(ValueError):
            NgramIndex(**kw)


def test_deterministic():
    def run() -> list:
        idx = NgramIndex(capacity=64, min_window=1, max_window=3, branch_length=4)
        rng = random.Random(7)
        got = []
        for _ in range(30):
            idx.insert([rng.randrange(12) for _ in range(25)])
            got.append(idx.lookup([rng.randrange(12) for _ in range(5)]))
        return got
    assert run() == run()
