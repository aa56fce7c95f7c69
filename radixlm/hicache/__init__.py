"""HiCache: a host-memory KV tier under the radix cache (semantics §6). See README.md."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable

from radixlm.hicache.controller import CacheController, LoadFencedRunner
from radixlm.hicache.hiradix_cache import LOAD_BACK_THRESHOLD, WRITE_POLICIES, HiRadixCache
from radixlm.hicache.host_pool import MIN_FREE_RAM_BYTES, HostKVPool, host_pool_size

if TYPE_CHECKING:
    import torch

    from radixlm.config import ServerArgs
    from radixlm.radix_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator

logger = logging.getLogger(__name__)

__all__ = ["CacheController", "HiRadixCache", "HostKVPool", "LoadFencedRunner", "WRITE_POLICIES",
           "LOAD_BACK_THRESHOLD", "build_hiradix_cache"]


def build_hiradix_cache(args: "ServerArgs", req_to_token_pool: "ReqToTokenPool",
                        allocator: "TokenToKVPoolAllocator",
                        device_buffers: "list[torch.Tensor] | Callable[[], list[torch.Tensor]]", *,
                        copy_hook: Callable[[str], None] | None = None,
                        min_free_bytes: int = MIN_FREE_RAM_BYTES) -> HiRadixCache:
    """Host pool (sized from `hicache_size` GB or `hicache_ratio`) + controller + tree.
    `device_buffers`: the device KV pool's per-slot buffers (every layer's K and V, plus their
    scales for an int8 pool: `MHATokenToKVPool.slot_buffers()`), or a function returning the
    live ones."""
    buffers = device_buffers() if callable(device_buffers) else device_buffers
    sizing = host_pool_size(allocator.capacity, buffers, ratio=args.hicache_ratio,
                            size_gb=args.hicache_size, page_size=args.page_size)
    if sizing.capacity <= allocator.capacity:
        # Still correct (host eviction can drop mirrors of device-resident nodes), but a host
        # tier no larger than the device one can hold little that the device does not.
        logger.warning("HiCache host pool (%d tokens) is not larger than the device pool (%d tokens)",
                       sizing.capacity, allocator.capacity)
    host = HostKVPool(buffers, sizing.capacity, min_free_bytes=min_free_bytes)
    controller = CacheController(device_buffers, host, copy_hook=copy_hook)
    return HiRadixCache(req_to_token_pool, allocator, args.page_size, args.radix_eviction_policy,
                        host_pool=host, controller=controller, write_policy=args.hicache_write_policy)
