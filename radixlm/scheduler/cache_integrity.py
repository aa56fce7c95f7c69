"""The cache manager's invariants (`CacheManager.check_integrity`), over requests and pools.

Every KV slot 1..capacity has exactly one owner: the allocator's free list, the prefix cache
(`device_slots()`), or a live request's own part `row[cache_protected_len:kv_allocated_len]`;
slot 0 (the padding slot) has none. Each live request holds a distinct request slot and ordered,
page-aligned lengths; its cache-owned part `row[0:cache_protected_len]` is exactly the cache's
slots along the path it locks; the prefix cache's own invariants hold with the requests as its
lock holders; and free + evictable + protected + held by requests == capacity.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from radixlm.core import Req
from radixlm.radix_cache.integrity import check_slot_ownership

if TYPE_CHECKING:
    from radixlm.scheduler.cache_manager import CacheManager

__all__ = ["check_cache"]


def _idx(r: Req) -> int:
    assert r.req_pool_idx is not None, f"live request {r.rid!r} has no request slot"
    return r.req_pool_idx


def check_request_lengths(cm: CacheManager, live_reqs: list[Req]) -> None:
    max_len = cm.req_to_token_pool.max_context_len
    for r in live_reqs:
        _idx(r)
        assert 0 <= r.cache_protected_len <= r.kv_committed_len <= r.kv_allocated_len <= max_len, (
            f"request {r.rid!r}: bad KV lengths cache_protected_len={r.cache_protected_len} "
            f"kv_committed_len={r.kv_committed_len} kv_allocated_len={r.kv_allocated_len}")
        assert r.cache_protected_len % cm.page_size == 0, (
            f"request {r.rid!r}: cache_protected_len={r.cache_protected_len} not page aligned")
        if cm.disabled:
            assert r.cache_protected_len == 0, (
                f"request {r.rid!r}: cache_protected_len {r.cache_protected_len} with the cache disabled")
    cm.req_to_token_pool.check_integrity([_idx(r) for r in live_reqs])


def check_request_prefixes(cm: CacheManager, live_reqs: list[Req]) -> None:
    rows = cm.req_to_token_pool.req_to_token
    for r in live_reqs:
        node = r.last_node if r.last_node is not None else cm.prefix.root
        path = cm.prefix.path_indices(node)
        assert path.numel() == r.cache_protected_len, (
            f"request {r.rid!r}: cache_protected_len {r.cache_protected_len} but its last_node "
            f"path holds {path.numel()} tokens")
        own = rows[_idx(r), :r.cache_protected_len]
        assert torch.equal(own, path), (
            f"request {r.rid!r}: row[0:{r.cache_protected_len}] differs from the tree's slots on its locked path")


def check_conservation(cm: CacheManager, live_reqs: list[Req]) -> None:
    free = cm.available()
    evictable, protected = cm.prefix.evictable_size(), cm.prefix.protected_size()
    held = sum(r.kv_allocated_len - r.cache_protected_len for r in live_reqs)
    total = free + evictable + protected + held
    assert total == cm.capacity, (
        f"KV slot accounting: free {free} + evictable {evictable} + protected {protected} + held by "
        f"requests {held} = {total} != capacity {cm.capacity}")


def check_cache(cm: CacheManager, live_reqs: list[Req]) -> None:
    check_request_lengths(cm, live_reqs)
    cm.prefix.check_integrity([(f"request {r.rid!r}", r.last_node) for r in live_reqs])
    check_request_prefixes(cm, live_reqs)
    check_conservation(cm, live_reqs)
    rows = cm.req_to_token_pool.req_to_token
    owners = [("allocator free list", torch.tensor(sorted(cm.allocator.free_slots()), dtype=torch.int64)),
              ("radix tree", cm.prefix.device_slots())]
    owners += [(f"request {r.rid!r}", rows[_idx(r), r.cache_protected_len:r.kv_allocated_len]) for r in live_reqs]
    check_slot_ownership(cm.capacity, owners)
