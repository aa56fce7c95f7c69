"""Eviction order of every policy: three single-node leaves A, B, C, evicted one at a time."""
from __future__ import annotations

import pytest

from radixlm.radix_cache.eviction import EVICTION_POLICIES, EvictionPolicy
from radixlm.radix_cache.prefix_cache import RadixKey
from radixlm.radix_cache.radix_cache import RadixCache
from radixlm.scheduler.cache_manager import CacheManager
from test.support.radix_helpers import build_cache

SEQS = {"A": [1, 1], "B": [2, 2], "C": [3, 3]}


def setup(policy: str, priorities: dict[str, int] | None = None) -> CacheManager:
    c = build_cache(policy=policy)
    assert isinstance(c.prefix, RadixCache)
    for name, toks in SEQS.items():  # created in order A, B, C
        v = c.allocator.alloc(len(toks))
        c.prefix.insert(RadixKey(toks), v, priority=(priorities or {}).get(name, 0))
    return c


def eviction_order(c: CacheManager) -> list[str]:
    """Evict one leaf at a time and see which one left, without touching access times."""
    order = []
    while c.prefix.total_size():
        present = {tuple(n.key.token_ids) for n in c.prefix.root.children.values()}
        c.evict(1)
        after = {tuple(n.key.token_ids) for n in c.prefix.root.children.values()}
        (gone,) = present - after
        order.append(next(k for k, t in SEQS.items() if tuple(t) == gone))
        c.check_integrity([])
    return order


def touch(c: CacheManager, *names: str) -> None:
    for n in names:
        c.prefix.match(RadixKey(SEQS[n]))


def test_registry_names_and_unknown() -> None:
    assert {"lru", "lfu", "fifo", "priority", "mru", "filo", "slru"} <= set(EVICTION_POLICIES.names())
    for name in EVICTION_POLICIES.names():
        assert issubclass(EVICTION_POLICIES.get(name), EvictionPolicy)
    with pytest.raises(ValueError, match="unknown eviction policy"):
        build_cache(policy="nope")


def test_lru() -> None:
    c = setup("lru")
    touch(c, "A")
    assert eviction_order(c) == ["B", "C", "A"]


def test_mru() -> None:
    c = setup("mru")
    touch(c, "A")
    assert eviction_order(c) == ["A", "C", "B"]


def test_fifo_ignores_use() -> None:
    c = setup("fifo")
    touch(c, "A", "A")
    assert eviction_order(c) == ["A", "B", "C"]


def test_filo() -> None:
    c = setup("filo")
    touch(c, "C")
    assert eviction_order(c) == ["C", "B", "A"]


def test_lfu_then_lru() -> None:
    c = setup("lfu")
    touch(c, "A", "A", "B", "C")  # hits A=2, B=1, C=1; B older than C
    assert eviction_order(c) == ["B", "C", "A"]


def test_priority_then_lru() -> None:
    c = setup("priority", {"A": 5, "B": 1, "C": 1})
    touch(c, "B")  # equal priority: C is less recent than B
    assert eviction_order(c) == ["C", "B", "A"]


def test_slru_probation_first() -> None:
    c = setup("slru")
    touch(c, "A", "A", "B")  # A protected (2 hits); B, C on probation, C older
    assert eviction_order(c) == ["C", "B", "A"]


def test_inserting_reuses_touch_for_lru() -> None:
    c = setup("lru")
    v = c.allocator.alloc(2)
    assert c.prefix.insert(RadixKey(SEQS["A"]), v) == 2  # re-insert counts as an access
    c.allocator.free(v)
    assert eviction_order(c) == ["B", "C", "A"]
