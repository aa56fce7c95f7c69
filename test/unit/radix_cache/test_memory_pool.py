"""TokenToKVPoolAllocator: slots handed out once, frees validated, and freed slots come back
in ascending order once the fresh ones run out (adjacent rows read faster)."""
from __future__ import annotations

import pytest
import torch

from radixlm.radix_cache.memory_pool import TokenToKVPoolAllocator


def test_freed_slots_are_reused_in_ascending_order():
    a = TokenToKVPoolAllocator(12)
    first = a.alloc(12)
    assert first.tolist() == list(range(1, 13))
    assert a.alloc(1) is None
    a.free(torch.tensor([9, 3, 11]))
    a.free([5, 1, 7])
    assert a.available_size() == 6
    assert a.alloc(4).tolist() == [1, 3, 5, 7]
    assert a.alloc(2).tolist() == [9, 11]
    assert a.available_size() == 0


def test_double_free_and_out_of_range_are_rejected():
    a = TokenToKVPoolAllocator(4)
    slots = a.alloc(2)
    a.free(slots)
    with pytest.raises(AssertionError, match="double free"):
        a.free(slots[:1])
    with pytest.raises(AssertionError, match="out of range"):
        a.free([0])
    assert a.free_slots() == {1, 2, 3, 4}
