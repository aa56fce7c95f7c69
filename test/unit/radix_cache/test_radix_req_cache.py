"""Request-level caching through the cache manager: cache_prefill (chunked prefill), release (the
one release path: finish/abort/retract), check_integrity catching broken states, NoPrefixCache."""
from __future__ import annotations

import pytest
import torch

from radixlm.core import Req
from radixlm.radix_cache.integrity import check_slot_ownership
from radixlm.radix_cache.no_cache import NoPrefixCache
from radixlm.radix_cache.prefix_cache import PrefixCacheConfig, RadixKey
from radixlm.radix_cache.radix_cache import RadixCache
from radixlm.scheduler.cache_manager import CacheManager, build_prefix_cache
from test.support.radix_helpers import admit, build_cache, extend, make_req


def row(c: CacheManager, req: Req) -> list[int]:
    return c.req_to_token_pool.req_to_token[req.req_pool_idx].tolist()


def test_chunked_prefill_moves_lock_down() -> None:
    c = build_cache()
    req = make_req(list(range(10)))
    assert admit(c, req) == 0
    extend(c, req, 4)
    c.cache_prefill(req)
    assert req.cache_protected_len == 4 and req.last_node.lock_ref == 1
    assert c.prefix.protected_size() == 4 and c.prefix.evictable_size() == 0
    c.check_integrity([req])
    assert req.last_node.hit_count == 0  # the request's own re-match is not a reuse
    first = req.last_node
    extend(c, req, 6)
    c.cache_prefill(req)
    assert req.cache_protected_len == 10 and c.prefix.protected_size() == 10
    assert first.lock_ref == 1 and req.last_node is not first  # path still pinned through first
    c.check_integrity([req])
    assert c.evict(100) == 0  # everything is locked by the live request
    # Decode: one sampled token without KV yet, then finish.
    req.output_ids.append(42)
    c.release(req)
    assert req.req_pool_idx is None and req.last_node is None and req.kv_allocated_len == 0
    assert c.prefix.evictable_size() == 10 and c.prefix.protected_size() == 0
    c.check_integrity([])


def test_concurrent_duplicate_prefill_frees_duplicates() -> None:
    c = build_cache()
    a, b = make_req([5, 6, 7, 8, 9]), make_req([5, 6, 7, 8, 9, 10])
    admit(c, a)
    admit(c, b)  # both admitted before either cached anything
    extend(c, a, 5)
    extend(c, b, 6)
    free0 = c.allocator.available_size()
    c.cache_prefill(a)
    b_slots = row(c, b)[:6]
    c.cache_prefill(b)
    assert c.allocator.available_size() == free0 + 5  # b's duplicate copy of a's 5 tokens
    assert row(c, b)[:5] == row(c, a)[:5] and row(c, b)[5] == b_slots[5]
    assert b.cache_protected_len == 6 and c.prefix.protected_size() == 6
    c.check_integrity([a, b])
    c.release(a)
    c.check_integrity([b])
    c.release(b)
    assert c.prefix.evictable_size() == 6
    c.check_integrity([])


def test_finished_with_duplicates_and_unwritten_tail() -> None:
    c = build_cache()
    a, b = make_req([1, 2, 3, 4]), make_req([1, 2, 3, 4])
    admit(c, a)
    admit(c, b)
    extend(c, a, 4)
    extend(c, b, 6, n_write=4)  # two over-allocated slots never written
    c.release(a)
    free0 = c.allocator.available_size()
    c.release(b)  # 4 duplicates + 2 unwritten
    assert c.allocator.available_size() == free0 + 6
    assert c.prefix.total_size() == 4
    c.check_integrity([])


def test_committed_shorter_than_fill_ids_inserts_only_computed() -> None:
    c = build_cache()
    req = make_req([1, 2, 3])
    admit(c, req)
    extend(c, req, 3)
    req.output_ids += [7]  # sampled, no KV yet
    extend(c, req, 1, n_write=0)  # slot reserved for the next decode step
    c.release(req)
    assert c.prefix.total_size() == 3
    assert len(c.prefix.match(RadixKey([1, 2, 3, 7])).device_indices) == 3
    c.check_integrity([])


def test_page_size_tail_stays_with_request_then_freed() -> None:
    c = build_cache(page_size=4)
    req = make_req(list(range(10)))
    admit(c, req)
    extend(c, req, 6)
    c.cache_prefill(req)
    assert req.cache_protected_len == 4 and c.prefix.protected_size() == 4
    c.check_integrity([req])
    extend(c, req, 4)
    c.cache_prefill(req)
    assert req.cache_protected_len == 8
    c.check_integrity([req])
    free0 = c.allocator.available_size()
    c.release(req)
    assert c.allocator.available_size() == free0 + 2 and c.prefix.total_size() == 8
    c.check_integrity([])
    # Re-admission matches the two whole pages only.
    again = make_req(list(range(10)))
    assert admit(c, again) == 8
    c.check_integrity([again])


def test_abort_without_insert_frees_own_slots_keeps_prefix() -> None:
    c = build_cache()
    first = make_req([1, 2, 3])
    admit(c, first)
    extend(c, first, 3)
    c.release(first)
    req = make_req([1, 2, 3, 4, 5])
    assert admit(c, req) == 3
    extend(c, req, 2)
    free0 = c.allocator.available_size()
    c.release(req, insert=False)
    assert c.allocator.available_size() == free0 + 2
    assert c.prefix.total_size() == 3 and c.prefix.protected_size() == 0
    c.check_integrity([])


def test_second_release_raises_and_frees_nothing() -> None:
    c = build_cache()
    req = make_req([1, 2, 3])
    admit(c, req)
    extend(c, req, 3)
    c.release(req)
    free0 = c.allocator.available_size()
    for insert in (True, False):
        with pytest.raises(RuntimeError, match="already released"):
            c.release(req, insert=insert)
    with pytest.raises(RuntimeError):
        c.cache_prefill(req)
    assert c.allocator.available_size() == free0
    c.check_integrity([])


def test_retract_then_evict_then_readmit() -> None:
    c = build_cache(capacity=16)
    req = make_req(list(range(8)))
    admit(c, req)
    extend(c, req, 8)
    req.output_ids += [100]
    c.release(req)  # retract: insert, unlock
    req.num_retractions += 1  # (release cleared the KV fields)
    assert c.evict(3) >= 3
    assert admit(c, req) == 0  # one node of 8: evicted whole
    c.check_integrity([req])
    c.release(req, insert=False)
    c.check_integrity([])


def test_check_integrity_catches_breakage() -> None:
    c = build_cache()
    req = make_req([1, 2, 3, 4])
    admit(c, req)
    extend(c, req, 4)
    c.cache_prefill(req)
    c.check_integrity([req])
    with pytest.raises(AssertionError, match="request slot leak|holder"):
        c.check_integrity([])  # a live request forgotten by the caller
    leaked = c.allocator.alloc(1)
    with pytest.raises(AssertionError, match="accounting"):
        c.check_integrity([req])
    c.allocator.free(leaked)
    req.last_node.lock_ref += 1
    with pytest.raises(AssertionError, match="lock_ref"):
        c.check_integrity([req])
    req.last_node.lock_ref -= 1
    c.prefix._evictable_size += 1
    with pytest.raises(AssertionError, match="accounting|counter"):
        c.check_integrity([req])
    c.prefix._evictable_size -= 1
    r = c.req_to_token_pool.req_to_token[req.req_pool_idx]
    r[0], r[1] = r[1].item(), r[0].item()
    with pytest.raises(AssertionError, match="differs from the tree"):
        c.check_integrity([req])
    r[0], r[1] = r[1].item(), r[0].item()
    c.check_integrity([req])


def test_slot_ownership_messages() -> None:
    t = lambda *x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    check_slot_ownership(4, [("free", t(1, 2)), ("tree", t(3)), ("req", t(4))])
    with pytest.raises(AssertionError, match=r"owned 2 times, by \['tree', 'req'\]"):
        check_slot_ownership(4, [("free", t(1, 2)), ("tree", t(3)), ("req", t(3, 4))])
    with pytest.raises(AssertionError, match="leaked"):
        check_slot_ownership(4, [("free", t(1, 2)), ("tree", t(3))])
    with pytest.raises(AssertionError, match=r"KV slot 0 .* owned by \['req'\]"):
        check_slot_ownership(4, [("free", t(1, 2, 3, 4)), ("req", t(0))])


def test_no_prefix_cache_keeps_everything_with_the_request() -> None:
    c = build_cache(disabled=True)
    assert isinstance(c.prefix, NoPrefixCache) and c.disabled
    req = make_req([1, 2, 3, 4, 5])
    assert admit(c, req) == 0
    extend(c, req, 3)
    c.cache_prefill(req)
    assert req.cache_protected_len == 0 and c.prefix.total_size() == 0
    c.check_integrity([req])
    extend(c, req, 3, n_write=2)
    assert c.prefix.insert(RadixKey([1, 2]), torch.tensor([1, 2])) == 0
    assert c.evict(10) == 0
    c.release(req)
    assert c.allocator.available_size() == c.allocator.capacity
    c.check_integrity([])
    with pytest.raises(RuntimeError):
        c.release(req)
    assert "disabled" in c.prefix.pretty_print()


def test_create_prefix_cache_factory() -> None:
    assert isinstance(build_prefix_cache(PrefixCacheConfig("radix", page_size=2, eviction_policy="lfu")), RadixCache)
    assert isinstance(build_prefix_cache(PrefixCacheConfig("none")), NoPrefixCache)
