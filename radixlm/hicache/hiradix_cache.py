"""HiRadixCache: the radix tree with a host-memory tier under it (docs/semantics.md §6).

The tree is `RadixCache` itself (its nodes `HiTreeNode`s); the host tier is a `HostTier` object
the cache holds and that follows the tree through its hooks. This class only adds what the
prefix-cache contract asks of a lower tier:
- `match` reports, past the device-resident prefix, the host-only nodes that continue it
  (`HiMatchResult.host_hit_length`, `last_host_node`);
- `load_back` brings them back into device slots the cache manager hands it;
- `evict` short of tokens because copies pin nodes waits for those copies instead of failing;
- `poll` (acks), `before_forward` (the forward waits for its loads), metrics and integrity.

A node is device only (`value`), backed up (`value` and `host_value`, the host copy valid once
its write is acked) or host only (`value is None`). Both tiers are prefix-closed (under the
write-through policies; write_back may back up a node before its parent), and a host-only node
has only host-only descendants.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from radixlm.hicache.controller import CacheController
from radixlm.hicache.host_pool import MIN_FREE_RAM_BYTES, HostKVPool, host_pool_size
from radixlm.hicache.host_tier import LOAD_BACK_THRESHOLD, WRITE_POLICIES, HiTreeNode, HostTier, hi
from radixlm.hicache.storage import StorageBackend
from radixlm.hicache.storage_tier import StorageOptions, StorageTier
from radixlm.radix_cache.prefix_cache import (
    PREFIX_CACHES,
    DeviceKV,
    LockHolder,
    MatchResult,
    PrefixCacheConfig,
    RadixKey,
    SlotAllocator,
    TreeNode,
)
from radixlm.radix_cache.radix_cache import RadixCache

logger = logging.getLogger(__name__)

__all__ = ["HiRadixCache", "HiMatchResult", "HiTreeNode", "WRITE_POLICIES", "LOAD_BACK_THRESHOLD",
           "build_hiradix_cache"]


@dataclass
class HiMatchResult(MatchResult):
    host_hit_length: int = 0  # tokens matched in host-only nodes past `last_node`
    last_host_node: TreeNode | None = None  # the deepest of them


class HiRadixCache(RadixCache):
    def __init__(self, page_size: int = 1, eviction_policy: str = "lru", *, host_pool: HostKVPool,
                 controller: CacheController, write_policy: str = "write_through",
                 load_back_threshold: int = LOAD_BACK_THRESHOLD) -> None:
        self.host: HostTier | None = None  # reset() below runs before the tier exists
        self.storage: StorageTier | None = None
        tier = HostTier(self, host_pool, controller, write_policy, load_back_threshold)
        super().__init__(page_size, eviction_policy, hooks=tier, node_type=HiTreeNode)
        self.host = tier

    def attach_storage(self, backend: StorageBackend, options: StorageOptions) -> StorageTier:
        """Put a storage tier under the host tier: acked host copies are stored, prompts
        prefetch from it."""
        self.storage = StorageTier(self, backend, options)
        self.tier.on_host_written = self.storage.on_host_written
        return self.storage

    @property
    def tier(self) -> HostTier:
        assert self.host is not None
        return self.host

    # ---- the host tier's parts, as the tests and the benchmark read them ----
    @property
    def host_pool(self) -> HostKVPool:
        return self.tier.host_pool

    @property
    def controller(self) -> CacheController:
        return self.tier.controller

    @property
    def write_policy(self) -> str:
        return self.tier.write_policy

    @property
    def stats(self) -> dict[str, int]:
        return self.tier.stats

    def host_pending(self, node: TreeNode) -> bool:
        """True while `node`'s host copy is still being written."""
        return hi(node) in self.tier.host_pending

    def device_pending(self, node: TreeNode) -> bool:
        """True while `node`'s device copy is still being loaded."""
        return hi(node) in self.tier.device_pending

    def check_events(self) -> None:
        self.tier.check_events()

    def evict_host(self, num_tokens: int) -> int:
        return self.tier.evict_host(num_tokens)

    # ------------------------------------------------------------------ the contract
    def reset(self) -> None:
        # Flush only runs when the scheduler is idle, so waiting for the copies is short.
        if self.host is not None:
            self.host.clear()
        if self.storage is not None:
            self.storage.clear()
        super().reset()

    def match(self, key: RadixKey, *, count_hit: bool = True) -> HiMatchResult:
        path = self.walk(key, count_hit)
        dev = self.device_match(path)
        on_host = path[next((i for i, n in enumerate(path) if n.value is None), len(path)):]
        assert all(n.value is None for n in on_host), "a device-resident node below a host-only one"
        return HiMatchResult(dev.device_indices, dev.last_node, sum(len(n.key) for n in on_host),
                             on_host[-1] if on_host else None)

    def load_back(self, match: MatchResult, quota: int, alloc: SlotAllocator) -> MatchResult:
        if not isinstance(match, HiMatchResult) or not match.host_hit_length:
            return match
        loaded = self.tier.load_back(match.last_host_node, alloc, quota)
        if loaded is None or match.last_host_node is None:
            return match
        return MatchResult(torch.cat([match.device_indices, loaded]), match.last_host_node)

    def evict(self, num_tokens: int) -> torch.Tensor:
        freed = super().evict(num_tokens)
        if freed.numel() < num_tokens and self.tier.copies_in_flight():
            # In-flight copies pin nodes (e.g. a just-retracted request's KV being written
            # through): under pressure, wait for them rather than retract or fail.
            self.stats["copy_waits_under_pressure"] += 1
            self.tier.drain()
            freed = torch.cat([freed, super().evict(num_tokens - int(freed.numel()))])
        return freed

    def poll(self) -> None:
        self.tier.check_events()
        if self.storage is not None:
            self.storage.poll()

    def prefetch_ready(self, key: RadixKey, owner: str) -> bool:
        return True if self.storage is None else self.storage.ready(key, owner)

    def before_forward(self) -> None:
        self.tier.controller.fence_loads()

    def drain(self) -> None:
        self.tier.drain()

    def copy_pinned_size(self) -> int:
        return self.tier.copy_pinned_size()

    def tier_stats(self) -> dict[str, Any]:
        out = self.tier.summary()
        if self.storage is not None:
            out["storage"] = self.storage.summary()
        return out

    def describe(self) -> str:
        return (f"HiRadixCache(policy={self.write_policy}, evictable={self._evictable_size}, "
                f"protected={self._protected_size}, host used {self.host_pool.used_size()}/"
                f"{self.host_pool.capacity})")

    def check_integrity(self, holders: list[LockHolder]) -> None:
        from radixlm.hicache.integrity import check_hiradix_cache

        check_hiradix_cache(self, holders)


def build_hiradix_cache(config: PrefixCacheConfig, device: DeviceKV) -> HiRadixCache:
    """Host pool (sized from `hicache_size_gb` or `hicache_ratio`) + controller + tree.
    `device.buffers`: the device KV pool's per-slot buffers (every layer's K and V, plus their
    scales for an int8 pool: `MHATokenToKVPool.slot_buffers`), or a function returning the live
    ones."""
    buffers = device.buffers() if callable(device.buffers) else device.buffers
    sizing = host_pool_size(device.capacity, buffers, ratio=config.hicache_ratio, size_gb=config.hicache_size_gb,
                            page_size=config.page_size)
    if sizing.capacity <= device.capacity:
        # Still correct (host eviction can drop mirrors of device-resident nodes), but a host
        # tier no larger than the device one can hold little that the device does not.
        logger.warning("HiCache host pool (%d tokens) is not larger than the device pool (%d tokens)",
                       sizing.capacity, device.capacity)
    min_free = MIN_FREE_RAM_BYTES if device.min_free_bytes is None else device.min_free_bytes
    host = HostKVPool(buffers, sizing.capacity, min_free_bytes=min_free)
    controller = CacheController(device.buffers, host, copy_hook=device.copy_hook, ranks=device.ranks)
    cache = HiRadixCache(config.page_size, config.eviction_policy, host_pool=host, controller=controller,
                         write_policy=config.hicache_write_policy)
    if config.hicache_storage_backend is not None:
        from radixlm.hicache.storage_backends import build_storage_backend

        cache.attach_storage(build_storage_backend(config.hicache_storage_backend, config.hicache_storage_dir,
                                                   config.hicache_storage_backend_extra_config),
                             StorageOptions(config.hicache_storage_prefetch_policy,
                                            config.hicache_storage_prefetch_threshold,
                                            config.hicache_storage_prefetch_timeout, config.storage_model_id))
    return cache


PREFIX_CACHES.register("hiradix")(build_hiradix_cache)
