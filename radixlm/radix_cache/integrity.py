"""Invariant checks for the prefix caches (`check_integrity`), as code rather than comments.

Every KV slot 1..capacity has exactly one owner: the allocator's free list, a tree node's
`value`, or a live request's own part `row[cache_protected_len:kv_allocated_len]`. Slot 0 (the
padding slot) has none. Tree counters must match a recount, locks must match the live requests
that hold them, and each request's tree-owned part of its row must be the tree's slots along its
locked path. Failures raise AssertionError naming the slot, node or request.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from radixlm.core import Req
    from radixlm.radix_cache.base import BasePrefixCache
    from radixlm.radix_cache.radix_cache import RadixCache, TreeNode

__all__ = ["check_radix_cache", "check_request_lengths", "check_slot_ownership", "check_conservation"]


def check_request_lengths(cache: "BasePrefixCache", live_reqs: list["Req"]) -> None:
    """Each live request holds a distinct request slot and ordered KV lengths; the request
    pool accounts for every slot."""
    max_len = cache.req_to_token_pool.max_context_len
    for r in live_reqs:
        assert r.req_pool_idx is not None, f"live request {r.rid!r} has no request slot"
        assert 0 <= r.cache_protected_len <= r.kv_committed_len <= r.kv_allocated_len <= max_len, (
            f"request {r.rid!r}: bad KV lengths cache_protected_len={r.cache_protected_len} "
            f"kv_committed_len={r.kv_committed_len} kv_allocated_len={r.kv_allocated_len}")
        assert r.cache_protected_len % cache.page_size == 0, (
            f"request {r.rid!r}: cache_protected_len={r.cache_protected_len} not page aligned")
    cache.req_to_token_pool.check_integrity([r.req_pool_idx for r in live_reqs])  # type: ignore[misc]


def check_conservation(cache: "BasePrefixCache", live_reqs: list["Req"]) -> None:
    free = cache.allocator.available_size()
    held = sum(r.kv_allocated_len - r.cache_protected_len for r in live_reqs)
    total = free + cache.evictable_size() + cache.protected_size() + held
    assert total == cache.allocator.capacity, (
        f"KV slot accounting: free {free} + evictable {cache.evictable_size()} + protected "
        f"{cache.protected_size()} + held by requests {held} = {total} != capacity "
        f"{cache.allocator.capacity}")


def check_slot_ownership(capacity: int, owners: list[tuple[str, torch.Tensor]]) -> None:
    """Slots 1..capacity owned exactly once across `owners`; slot 0 by nobody."""
    parts = [t.to(torch.int64).flatten() for _, t in owners if t.numel()]
    allidx = torch.cat(parts) if parts else torch.empty((0,), dtype=torch.int64)
    if allidx.numel():
        lo, hi = int(allidx.min()), int(allidx.max())
        if lo < 1 or hi > capacity:
            bad = lo if lo < 1 else hi
            who = [name for name, t in owners if bool((t == bad).any())]
            raise AssertionError(f"KV slot {bad} (outside 1..{capacity}) is owned by {who}")
    counts = torch.bincount(allidx, minlength=capacity + 1)
    dup = (counts > 1).nonzero().flatten().tolist()
    if dup:
        s = dup[0]
        who = [name for name, t in owners if bool((t == s).any())]
        raise AssertionError(f"KV slot {s} owned {int(counts[s])} times, by {who} "
                             f"({len(dup)} slots have several owners)")
    leaked = (counts[1:] == 0).nonzero().flatten().add(1).tolist()
    if leaked:
        raise AssertionError(f"{len(leaked)} KV slots owned by nobody (leaked): {leaked[:8]}")


def _request_owners(cache: "BasePrefixCache", live_reqs: list["Req"]) -> list[tuple[str, torch.Tensor]]:
    rows = cache.req_to_token_pool.req_to_token
    return [(f"request {r.rid!r}", rows[r.req_pool_idx, r.cache_protected_len:r.kv_allocated_len])
            for r in live_reqs]


def _check_tree_shape(cache: "RadixCache") -> None:
    root = cache.root
    assert root.parent is None and len(root.key) == 0, "root must have no parent and an empty key"
    assert root.value is not None and root.value.numel() == 0, "root must hold no KV slots"
    assert root.lock_ref == 1, f"root lock_ref is {root.lock_ref}, must stay 1"
    evictable = protected = 0
    leaves: set["TreeNode"] = set()
    for node in cache.iter_nodes():
        for ck, child in node.children.items():
            assert child.parent is node, f"{child!r}: parent link does not point to its parent {node!r}"
            assert len(child.key) > 0, f"{child!r}: empty key below {node!r}"
            assert ck == cache._child_key(child.key), (
                f"{child!r} is filed under child key {ck!r} but its key starts "
                f"{cache._child_key(child.key)!r}")
            if node is not root:
                assert child.key.extra_key == node.key.extra_key, (
                    f"{child!r}: extra_key {child.key.extra_key!r} differs from parent's "
                    f"{node.key.extra_key!r}")
        if node is root:
            continue
        v = node.value
        assert v is not None, f"{node!r} is evicted but still in the tree"
        assert v.dtype == torch.int64 and v.dim() == 1, f"{node!r}: value must be 1-D int64"
        assert v.numel() == len(node.key), f"{node!r}: {v.numel()} slots for {len(node.key)} tokens"
        assert len(node.key) % cache.page_size == 0, f"{node!r}: length not a page multiple"
        assert node.lock_ref >= 0, f"{node!r}: negative lock_ref"
        if node.lock_ref > 0:
            protected += len(node.key)
        else:
            evictable += len(node.key)
            if not node.children:
                leaves.add(node)
    assert_counters(cache, evictable, protected, leaves, "evictable-leaf set")


def assert_counters(cache, evictable: int, protected: int, leaves: set, leaf_set_name: str) -> None:
    """The tree's incremental counters and evictable-leaf set equal a fresh recount."""
    assert evictable == cache.evictable_size(), (
        f"evictable_size counter {cache.evictable_size()} != recount {evictable}")
    assert protected == cache.protected_size(), (
        f"protected_size counter {cache.protected_size()} != recount {protected}")
    assert leaves == cache._evictable_leaves, (
        f"{leaf_set_name} out of date: missing {list(leaves - cache._evictable_leaves)[:4]}, "
        f"stale {list(cache._evictable_leaves - leaves)[:4]}")


def _check_locks(cache: "RadixCache", live_reqs: list["Req"]) -> None:
    """lock_ref of every node == number of holders (live requests' last nodes and the cache's
    own extra holders) in its subtree. This implies locked nodes have locked ancestors."""
    expected: dict[int, int] = {}
    holders = [(f"request {r.rid!r}", r.last_node) for r in live_reqs]
    holders += [("cache", n) for n in cache._extra_lock_holders()]
    for who, node in holders:
        if node is None or node is cache.root:
            continue
        try:
            path = cache._path_to_root(node)
        except RuntimeError as e:
            raise AssertionError(f"{who} locks {node!r}, which is not in this tree: {e}") from None
        for n in path:
            expected[n.id] = expected.get(n.id, 0) + 1
    for node in cache.iter_nodes():
        if node is cache.root:
            continue
        want = expected.get(node.id, 0)
        assert node.lock_ref == want, (
            f"{node!r}: lock_ref {node.lock_ref} but {want} holder(s) lock through it "
            f"(leaked or missing inc/dec_lock_ref)")


def _check_request_prefixes(cache: "RadixCache", live_reqs: list["Req"]) -> None:
    rows = cache.req_to_token_pool.req_to_token
    for r in live_reqs:
        node = r.last_node if r.last_node is not None else cache.root
        path = cache.path_indices(node)
        assert path.numel() == r.cache_protected_len, (
            f"request {r.rid!r}: cache_protected_len {r.cache_protected_len} but its last_node "
            f"path holds {path.numel()} tokens")
        own = rows[r.req_pool_idx, :r.cache_protected_len]
        assert torch.equal(own, path), (
            f"request {r.rid!r}: row[0:{r.cache_protected_len}] differs from the tree's slots on "
            f"its locked path")


def check_radix_cache(cache: "RadixCache", live_reqs: list["Req"]) -> None:
    check_request_lengths(cache, live_reqs)
    _check_tree_shape(cache)
    _check_locks(cache, live_reqs)
    _check_request_prefixes(cache, live_reqs)
    check_conservation(cache, live_reqs)
    tree_vals = [n.value for n in cache.iter_nodes() if n is not cache.root and n.value is not None]
    owners = [("allocator free list", torch.tensor(sorted(cache.allocator.free_slots()), dtype=torch.int64)),
              ("radix tree", torch.cat(tree_vals) if tree_vals else torch.empty((0,), dtype=torch.int64))]
    owners += _request_owners(cache, live_reqs)
    check_slot_ownership(cache.allocator.capacity, owners)


def check_no_cache(cache: "BasePrefixCache", live_reqs: list["Req"]) -> None:
    check_request_lengths(cache, live_reqs)
    for r in live_reqs:
        assert r.cache_protected_len == 0, (
            f"request {r.rid!r}: cache_protected_len {r.cache_protected_len} with the cache disabled")
    check_conservation(cache, live_reqs)
    owners = [("allocator free list", torch.tensor(sorted(cache.allocator.free_slots()), dtype=torch.int64))]
    owners += _request_owners(cache, live_reqs)
    check_slot_ownership(cache.allocator.capacity, owners)
