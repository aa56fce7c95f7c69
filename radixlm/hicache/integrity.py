"""Invariant checks of HiRadixCache (`check_integrity`): the tree over two tiers and the host pool.

Device side: as the plain tree (links, pages, counters and device-leaf set equal a recount, locks
equal their holders, copies in flight counted as holders), except that a node may be host-only.
Tiers: a host-only node has a host copy, no lock and only host-only descendants; under the
write-through policies the host set is prefix-closed; every in-flight copy's node is
device-resident and locked. Host pool: every host slot 1..capacity owned once, by the host free
list or a node's `host_value`. (The device pool's slot ownership is the cache manager's check.)
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from radixlm.hicache.host_tier import HiTreeNode, hi
from radixlm.radix_cache.integrity import (
    assert_counters,
    check_index,
    check_locks,
    check_root,
    check_slot_ownership,
    check_tree_links,
)
from radixlm.radix_cache.prefix_cache import LockHolder, TreeNode

if TYPE_CHECKING:
    from radixlm.hicache.hiradix_cache import HiRadixCache

__all__ = ["check_hiradix_cache"]


def _check_tiers(cache: HiRadixCache) -> None:
    check_root(cache)
    root = hi(cache.root)
    assert root.host_value is None, "root must hold no host slots"
    closed = cache.write_policy != "write_back"
    evictable = protected = 0
    leaves: set[TreeNode] = set()
    for node in map(hi, cache.iter_nodes()):
        check_tree_links(cache, node)
        if node is root:
            continue
        assert len(node.key) % cache.page_size == 0, f"{node!r}: length not a page multiple"
        assert node.lock_ref >= 0, f"{node!r}: negative lock_ref"
        if node.host_value is not None:
            check_index(node, node.host_value, "host")
            if closed and node.parent is not root and node.parent is not None:
                assert hi(node.parent).host_value is not None, (
                    f"{node!r} is backed up but its parent is not (host set not prefix-closed under "
                    f"{cache.write_policy})")
        if node.value is None:
            assert node.host_value is not None, f"{node!r} is evicted from the device without a host copy"
            assert node.lock_ref == 0, f"{node!r}: host-only node is locked"
            assert all(c.value is None for c in node.children.values()), (
                f"{node!r}: host-only node has a device-resident child")
            continue
        check_index(node, node.value, "device")
        if node.lock_ref > 0:
            protected += len(node.key)
        else:
            evictable += len(node.key)
            if not any(c.value is not None for c in node.children.values()):
                leaves.add(node)
    assert_counters(cache, evictable, protected, leaves, "device-leaf set")


def _check_copies(cache: HiRadixCache) -> None:
    tier = cache.tier
    in_tree: set[HiTreeNode] = set(map(hi, cache.iter_nodes()))
    writes, loads = tier.controller.num_pending()
    assert writes == len(tier.ongoing_writes) and loads == len(tier.ongoing_loads), (
        f"controller has {writes} writes / {loads} loads unacknowledged, the tree tracks "
        f"{len(tier.ongoing_writes)} / {len(tier.ongoing_loads)}")
    for kind, ongoing in (("write", tier.ongoing_writes), ("load", tier.ongoing_loads)):
        for op, node in ongoing.items():
            assert node in in_tree, f"{kind} op {op}: {node!r} is not in the tree"
            assert node.value is not None and node.lock_ref > 0, (
                f"{kind} op {op}: {node!r} must stay device-resident and locked until its ack")
    for node in tier.host_pending:
        assert node in in_tree and node.value is not None and node.host_value is not None, (
            f"{node!r}: host copy being written but the node is not backed-up and device-resident")
        assert node.lock_ref > 0, f"{node!r}: host copy being written but the node is unlocked"
    for node in tier.device_pending:
        assert node in in_tree and node.value is not None and node.host_value is not None, (
            f"{node!r}: device copy being loaded but the node is not in both tiers")
        assert node.lock_ref > 0, f"{node!r}: device copy being loaded but the node is unlocked"
    assert not tier.host_pinned, f"host pins left behind: {list(tier.host_pinned)[:4]}"


def _check_host_pool(cache: HiRadixCache) -> None:
    host = [n.host_value for n in map(hi, cache.iter_nodes()) if n.host_value is not None]
    used = sum(int(h.numel()) for h in host)
    pool = cache.host_pool
    assert pool.available_size() + used == pool.capacity, (
        f"host pool accounting: free {pool.available_size()} + used by the tree {used} != capacity {pool.capacity}")
    check_slot_ownership(pool.capacity, [
        ("host free list", torch.tensor(sorted(pool.free_slots()), dtype=torch.int64)),
        ("host tier of the tree", torch.cat(host) if host else torch.empty((0,), dtype=torch.int64))])


def check_hiradix_cache(cache: HiRadixCache, holders: list[LockHolder]) -> None:
    _check_tiers(cache)
    check_locks(cache, holders + cache.tier.lock_holders())
    _check_copies(cache)
    _check_host_pool(cache)
