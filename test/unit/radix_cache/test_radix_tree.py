"""RadixCache tree operations: match, split, insert, locks, eviction, namespaces, pages."""
from __future__ import annotations

import time

import pytest
import torch

from radixlm.radix_cache.prefix_cache import RadixKey
from radixlm.scheduler.cache_manager import CacheManager
from test.support.radix_helpers import build_cache


def K(*toks: int, ek: str | None = None) -> RadixKey:
    return RadixKey(list(toks), ek)


def put(c: CacheManager, key: RadixKey, priority: int = 0) -> tuple[int, torch.Tensor]:
    """Insert with fresh slots and free the duplicates, as callers must."""
    v = c.allocator.alloc(len(key))
    assert v is not None
    n = c.prefix.insert(key, v, priority=priority)
    c.allocator.free(v[:n])
    return n, v


def nodes(c: CacheManager) -> int:
    return sum(1 for _ in c.prefix.iter_nodes()) - 1


def test_empty_key_and_empty_tree() -> None:
    c = build_cache()
    m = c.prefix.match(K())
    assert m.last_node is c.prefix.root and m.device_indices.numel() == 0
    assert m.device_indices.dtype == torch.int64
    m = c.prefix.match(K(1, 2, 3))
    assert m.last_node is c.prefix.root and m.device_indices.numel() == 0
    assert c.prefix.insert(K(), torch.empty(0, dtype=torch.int64)) == 0
    c.check_integrity([])


def test_insert_returns_already_present_length() -> None:
    c = build_cache()
    n, v = put(c, K(1, 2, 3, 4))
    assert n == 0 and c.prefix.evictable_size() == 4 and c.prefix.total_size() == 4
    n, _ = put(c, K(1, 2, 3, 4))
    assert n == 4 and c.prefix.evictable_size() == 4
    n, _ = put(c, K(1, 2, 3, 4, 5, 6))
    assert n == 4 and c.prefix.evictable_size() == 6
    n, _ = put(c, K(1, 2, 9))
    assert n == 2 and c.prefix.evictable_size() == 7
    m = c.prefix.match(K(1, 2, 3, 4, 5, 6, 7))
    assert m.device_indices.tolist()[:4] == v.tolist()
    assert len(m.device_indices) == 6
    c.check_integrity([])


def test_match_splits_inside_node() -> None:
    c = build_cache()
    _, v = put(c, K(1, 2, 3, 4, 5))
    assert nodes(c) == 1
    m = c.prefix.match(K(1, 2, 3, 7))
    assert m.device_indices.tolist() == v[:3].tolist()
    assert nodes(c) == 2 and m.last_node.key.token_ids == [1, 2, 3]
    assert list(m.last_node.children.values())[0].key.token_ids == [4, 5]
    # Matching a key shorter than the node also splits so the boundary is exact.
    m = c.prefix.match(K(1))
    assert m.last_node.key.token_ids == [1] and nodes(c) == 3
    assert c.prefix.evictable_size() == 5
    c.check_integrity([])


def test_split_keeps_lock_and_stats() -> None:
    c = build_cache()
    _, v = put(c, K(1, 2, 3, 4))
    node = c.prefix.match(K(1, 2, 3, 4)).last_node
    c.prefix.lock(node)
    assert c.prefix.protected_size() == 4 and c.prefix.evictable_size() == 0
    m = c.prefix.match(K(1, 2))
    assert m.last_node.lock_ref == 1 and node.lock_ref == 1
    assert m.last_node.hit_count >= 2
    assert c.prefix.protected_size() == 4
    c.prefix.unlock(node)
    assert c.prefix.protected_size() == 0 and c.prefix.evictable_size() == 4
    assert m.last_node.lock_ref == 0
    c.check_integrity([])


def test_match_touches_path() -> None:
    c = build_cache()
    put(c, K(1, 2))
    put(c, K(1, 2, 3))
    leaf = c.prefix.match(K(1, 2, 3)).last_node
    mid = leaf.parent
    t0 = leaf.last_access_time
    h0 = mid.hit_count
    c.prefix.match(K(1, 2, 3))
    assert leaf.last_access_time > t0 and mid.last_access_time == leaf.last_access_time
    assert mid.hit_count == h0 + 1


def test_extra_key_namespaces_never_share() -> None:
    c = build_cache()
    put(c, K(1, 2, 3))
    n, v = put(c, K(1, 2, 3, ek="lora-a"))
    assert n == 0 and c.prefix.evictable_size() == 6
    assert c.prefix.match(K(1, 2, 3, ek="lora-a")).device_indices.tolist() == v.tolist()
    assert c.prefix.match(K(1, 2, 3, ek="lora-b")).device_indices.numel() == 0
    assert len(c.prefix.root.children) == 2
    c.check_integrity([])


def test_page_size_truncates_and_matches_whole_pages() -> None:
    c = build_cache(page_size=4)
    v = c.allocator.alloc(10)
    assert c.prefix.insert(K(*range(10)), v) == 0
    assert c.prefix.evictable_size() == 8  # the partial page stays out of the tree
    c.allocator.free(v[8:])
    assert c.prefix.match(K(*range(7))).device_indices.tolist() == v[:4].tolist()
    # Mismatch inside the second page: only the first page matches; the node is split at 4.
    m = c.prefix.match(K(0, 1, 2, 3, 4, 5, 99, 7))
    assert m.device_indices.tolist() == v[:4].tolist()
    assert m.last_node.key.token_ids == [0, 1, 2, 3]
    # Mismatch in the first page: nothing; sibling pages sharing a first token coexist.
    assert c.prefix.match(K(0, 1, 2, 99)).device_indices.numel() == 0
    w = c.allocator.alloc(4)
    assert c.prefix.insert(K(0, 1, 2, 99), w) == 0
    assert len(c.prefix.root.children) == 2
    assert c.prefix.match(K(0, 1, 2, 99)).device_indices.tolist() == w.tolist()
    c.check_integrity([])


def test_radix_key_normalizes_token_containers() -> None:
    c = build_cache()
    put(c, K(1, 2, 3))
    for toks in ((1, 2, 3), torch.tensor([1, 2, 3])):
        key = RadixKey(toks)  # type: ignore[arg-type]
        assert key.token_ids == [1, 2, 3]
        assert len(c.prefix.match(key).device_indices) == 3
    assert key[1:].token_ids == [2, 3] and len(key) == 3


def test_insert_value_too_short_raises() -> None:
    c = build_cache()
    with pytest.raises(ValueError):
        c.prefix.insert(K(1, 2, 3), torch.tensor([1, 2], dtype=torch.int64))


def test_priority_is_max_along_path() -> None:
    c = build_cache()
    put(c, K(1, 2, 3), priority=1)
    put(c, K(1, 2, 4), priority=5)
    node = c.prefix.match(K(1, 2)).last_node
    assert node.priority == 5
    assert c.prefix.match(K(1, 2, 3)).last_node.priority == 1


def test_locks_protect_and_unlock() -> None:
    c = build_cache()
    put(c, K(1, 2, 3, 4))
    put(c, K(1, 2, 5))
    leaf = c.prefix.match(K(1, 2, 3, 4)).last_node
    assert c.prefix.lock(leaf) == 4
    assert c.prefix.protected_size() == 4 and c.prefix.evictable_size() == 1
    assert c.prefix.lock(leaf) == 0  # already pinned: nothing moves
    assert c.evict(100) == 1  # only the unlocked sibling goes
    assert c.prefix.unlock(leaf) == 0
    assert c.prefix.unlock(leaf) == 4
    assert c.prefix.evictable_size() == 4 and c.prefix.protected_size() == 0
    with pytest.raises(RuntimeError, match="below zero"):
        c.prefix.unlock(leaf)
    assert c.prefix.lock(None) == 0 and c.prefix.unlock(None) == 0
    assert c.prefix.lock(c.prefix.root) == 0 and c.prefix.unlock(c.prefix.root) == 0
    assert c.prefix.root.lock_ref == 1
    c.check_integrity([])


def test_lock_on_stale_node_after_reset_raises() -> None:
    c = build_cache()
    put(c, K(1, 2))
    node = c.prefix.match(K(1, 2)).last_node
    c.prefix.reset()
    c.allocator.clear()
    with pytest.raises(RuntimeError, match="not in this tree"):
        c.prefix.lock(node)
    assert c.prefix.total_size() == 0
    c.check_integrity([])


def test_evict_cascades_and_frees_to_allocator() -> None:
    c = build_cache(capacity=32)
    put(c, K(1, 2, 3))
    put(c, K(1, 2, 3, 4, 5))
    put(c, K(1, 2, 3, 6))
    free0 = c.allocator.available_size()
    assert c.evict(0) == 0
    assert c.evict(1) == 2  # least recently used leaf [4, 5], whole
    assert c.prefix.match(K(1, 2, 3, 6)).device_indices.numel() == 4
    # [6] goes, then its parent [1, 2, 3] becomes an unlocked leaf and follows.
    assert c.evict(100) == 4
    assert c.prefix.total_size() == 0 and nodes(c) == 0
    assert c.allocator.available_size() == free0 + 6
    assert c.evict(10) == 0
    c.check_integrity([])


def test_evict_whole_leaves_may_exceed_request() -> None:
    c = build_cache()
    put(c, K(1, 2, 3, 4, 5))
    assert c.evict(1) == 5
    c.check_integrity([])


def test_evict_stops_at_locked_parent() -> None:
    c = build_cache()
    put(c, K(1, 2))
    put(c, K(1, 2, 3, 4))
    mid = c.prefix.match(K(1, 2)).last_node
    c.prefix.lock(mid)
    assert c.evict(100) == 2
    assert c.prefix.match(K(1, 2, 3, 4)).device_indices.numel() == 2
    c.prefix.unlock(mid)
    assert c.evict(100) == 2
    c.check_integrity([])


def test_pretty_print_and_reset(capsys: pytest.CaptureFixture[str]) -> None:
    c = build_cache()
    put(c, K(7, 8, 9, ek="ns"))
    text = c.prefix.pretty_print()
    assert "7 8 9" in text and "[ns]" in text and "7 8 9" in capsys.readouterr().out
    c.prefix.reset()
    assert c.prefix.total_size() == 0 and not c.prefix.root.children


def test_scale_many_nodes_is_fast() -> None:
    """~100k tokens in thousands of nodes: insert, match and evict stay well under a second each."""
    c = build_cache(capacity=120_000, max_context_len=128)
    g = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    for i in range(2000):
        shared = [i % 50] * 10  # 50 families of shared 10-token prefixes
        toks = shared + torch.randint(0, 1000, (40,), generator=g).tolist()
        put(c, RadixKey(toks))
    t_insert = time.perf_counter() - t0
    assert 80_000 <= c.prefix.total_size() <= 2000 * 40 + 50 * 10
    assert sum(1 for _ in c.prefix.iter_nodes()) > 2000
    t0 = time.perf_counter()
    for i in range(200):
        c.prefix.match(RadixKey([i % 50] * 10 + [1, 2, 3]))
    t_match = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(20):
        c.evict(2000)
    evicted_all = c.evict(10**9)
    t_evict = time.perf_counter() - t0
    assert evicted_all > 0 and c.prefix.total_size() == 0
    assert c.allocator.available_size() == c.allocator.capacity
    assert t_insert < 5 and t_match < 1 and t_evict < 5, (t_insert, t_match, t_evict)
