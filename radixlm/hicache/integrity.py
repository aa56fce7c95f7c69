"""Invariant checks of HiRadixCache (`check_integrity`), covering both pools.

Device pool: as the plain radix cache (every slot 1..capacity owned once by the free list, a
device-resident node or a live request; counters and locks match a recount), except that a
node may be host-only. Host pool: every host slot 1..capacity owned once, by the host free list
or a node's `host_value` (so host free + host used == host capacity). Tiers: a host-only node
has a host copy, no lock and only host-only descendants; under the write-through policies the
host set is prefix-closed; every in-flight copy's node is device-resident and locked.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from radixlm.radix_cache.integrity import (_check_locks, _check_request_prefixes, _request_owners,
                                           assert_counters, check_conservation, check_request_lengths,
                                           check_slot_ownership)

if TYPE_CHECKING:
    from radixlm.core import Req
    from radixlm.hicache.hiradix_cache import HiRadixCache

__all__ = ["check_hiradix_cache"]


def _check_index(node, t: torch.Tensor, what: str) -> None:
    assert t.dtype == torch.int64 and t.dim() == 1, f"{node!r}: {what} must be 1-D int64"
    assert t.numel() == len(node.key), f"{node!r}: {t.numel()} {what} slots for {len(node.key)} tokens"


def _check_tiers(cache: "HiRadixCache") -> None:
    root = cache.root
    assert root.parent is None and len(root.key) == 0, "root must have no parent and an empty key"
    assert root.value is not None and root.value.numel() == 0, "root must hold no KV slots"
    assert root.host_value is None, "root must hold no host slots"
    assert root.lock_ref == 1, f"root lock_ref is {root.lock_ref}, must stay 1"
    closed = cache.write_policy != "write_back"
    evictable = protected = 0
    leaves = set()
    for node in cache.iter_nodes():
        for ck, child in node.children.items():
            assert child.parent is node, f"{child!r}: parent link does not point to its parent {node!r}"
            assert len(child.key) > 0, f"{child!r}: empty key below {node!r}"
            assert ck == cache._child_key(child.key), f"{child!r} filed under the wrong child key {ck!r}"
            if node is not root:
                assert child.key.extra_key == node.key.extra_key, f"{child!r}: extra_key differs from parent's"
        if node is root:
            continue
        assert len(node.key) % cache.page_size == 0, f"{node!r}: length not a page multiple"
        assert node.lock_ref >= 0, f"{node!r}: negative lock_ref"
        if node.host_value is not None:
            _check_index(node, node.host_value, "host")
            if closed and node.parent is not root:
                assert node.parent.host_value is not None, (  # type: ignore[union-attr]
                    f"{node!r} is backed up but its parent is not (host set not prefix-closed under "
                    f"{cache.write_policy})")
        if node.value is None:
            assert node.host_value is not None, f"{node!r} is evicted from the device without a host copy"
            assert node.lock_ref == 0, f"{node!r}: host-only node is locked"
            assert all(c.value is None for c in node.children.values()), (
                f"{node!r}: host-only node has a device-resident child")
            continue
        _check_index(node, node.value, "device")
        if node.lock_ref > 0:
            protected += len(node.key)
        else:
            evictable += len(node.key)
            if not any(c.value is not None for c in node.children.values()):
                leaves.add(node)
    assert_counters(cache, evictable, protected, leaves, "device-leaf set")


def _check_copies(cache: "HiRadixCache") -> None:
    in_tree = set(cache.iter_nodes())
    writes, loads = cache.controller.num_pending()
    assert writes == len(cache._ongoing_writes) and loads == len(cache._ongoing_loads), (
        f"controller has {writes} writes / {loads} loads unacknowledged, the tree tracks "
        f"{len(cache._ongoing_writes)} / {len(cache._ongoing_loads)}")
    for kind, ongoing in (("write", cache._ongoing_writes), ("load", cache._ongoing_loads)):
        for op, node in ongoing.items():
            assert node in in_tree, f"{kind} op {op}: {node!r} is not in the tree"
            assert node.value is not None and node.lock_ref > 0, (
                f"{kind} op {op}: {node!r} must stay device-resident and locked until its ack")
    for node in cache._host_pending:
        assert node in in_tree and node.value is not None and node.host_value is not None, (
            f"{node!r}: host copy being written but the node is not backed-up and device-resident")
        assert node.lock_ref > 0, f"{node!r}: host copy being written but the node is unlocked"
    for node in cache._device_pending:
        assert node in in_tree and node.value is not None and node.host_value is not None, (
            f"{node!r}: device copy being loaded but the node is not in both tiers")
        assert node.lock_ref > 0, f"{node!r}: device copy being loaded but the node is unlocked"
    assert not cache._host_pinned, f"host pins left behind: {list(cache._host_pinned)[:4]}"


def check_hiradix_cache(cache: "HiRadixCache", live_reqs: list["Req"]) -> None:
    check_request_lengths(cache, live_reqs)
    _check_tiers(cache)
    _check_locks(cache, live_reqs)
    _check_request_prefixes(cache, live_reqs)
    _check_copies(cache)
    check_conservation(cache, live_reqs)
    nodes = [n for n in cache.iter_nodes() if n is not cache.root]
    dev = [n.value for n in nodes if n.value is not None]
    owners = [("allocator free list", torch.tensor(sorted(cache.allocator.free_slots()), dtype=torch.int64)),
              ("radix tree", torch.cat(dev) if dev else torch.empty((0,), dtype=torch.int64))]
    owners += _request_owners(cache, live_reqs)
    check_slot_ownership(cache.allocator.capacity, owners)
    host = [n.host_value for n in nodes if n.host_value is not None]
    used = sum(int(h.numel()) for h in host)
    pool = cache.host_pool
    assert pool.available_size() + used == pool.capacity, (
        f"host pool accounting: free {pool.available_size()} + used by the tree {used} != capacity {pool.capacity}")
    check_slot_ownership(pool.capacity, [
        ("host free list", torch.tensor(sorted(pool.free_slots()), dtype=torch.int64)),
        ("host tier of the tree", torch.cat(host) if host else torch.empty((0,), dtype=torch.int64))])
