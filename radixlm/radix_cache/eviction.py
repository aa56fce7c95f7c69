"""Eviction policies for the radix tree: which unlocked leaf goes first.

A policy maps a node to a sortable key; `RadixCache.evict` heaps the evictable leaves by
that key and pops the SMALLEST first. Keys are tuples/ints built from the node's
bookkeeping fields (`last_access_time`, `creation_time`, `hit_count`, `priority`), which
the tree keeps as monotonic counters, so ordering is deterministic and testable.
Ties are broken by the tree (node id), never by the policy.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

from radixlm.registry import Registry

if TYPE_CHECKING:
    from radixlm.radix_cache.prefix_cache import TreeNode

__all__ = ["EvictionPolicy", "EVICTION_POLICIES"]


class EvictionPolicy(ABC):
    """Maps a tree node to its eviction key; the smallest key is evicted first."""

    @abstractmethod
    def get_priority(self, node: TreeNode) -> Any: ...


EVICTION_POLICIES: Registry[type[EvictionPolicy]] = Registry("eviction policy")


@EVICTION_POLICIES.register("lru")
class LRUPolicy(EvictionPolicy):
    """Least recently used (match or insert touching the node) goes first."""

    def get_priority(self, node: TreeNode) -> Any:
        return node.last_access_time


@EVICTION_POLICIES.register("lfu")
class LFUPolicy(EvictionPolicy):
    """Fewest hits first; LRU among equally popular nodes."""

    def get_priority(self, node: TreeNode) -> Any:
        return (node.hit_count, node.last_access_time)


@EVICTION_POLICIES.register("fifo")
class FIFOPolicy(EvictionPolicy):
    """Oldest node first, regardless of use."""

    def get_priority(self, node: TreeNode) -> Any:
        return node.creation_time


@EVICTION_POLICIES.register("mru")
class MRUPolicy(EvictionPolicy):
    """Most recently used first (useful for cyclic scans larger than the cache)."""

    def get_priority(self, node: TreeNode) -> Any:
        return -node.last_access_time


@EVICTION_POLICIES.register("filo")
class FILOPolicy(EvictionPolicy):
    """Newest node first."""

    def get_priority(self, node: TreeNode) -> Any:
        return -node.creation_time


@EVICTION_POLICIES.register("priority")
class PriorityPolicy(EvictionPolicy):
    """Lowest request priority first (a node carries the max priority inserted through it);
    LRU among equal priorities."""

    def get_priority(self, node: TreeNode) -> Any:
        return (node.priority, node.last_access_time)


@EVICTION_POLICIES.register("slru")
class SLRUPolicy(EvictionPolicy):
    """Segmented LRU: nodes hit fewer than `protected_threshold` times form the probation
    segment and are evicted (LRU) before any node of the protected segment."""

    def __init__(self, protected_threshold: int = 2) -> None:
        self.protected_threshold = protected_threshold

    def get_priority(self, node: TreeNode) -> Any:
        return (node.hit_count >= self.protected_threshold, node.last_access_time)
