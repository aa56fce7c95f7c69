"""HiCache: a host-memory KV tier under the radix cache (docs/semantics.md §6). See README.md."""
from __future__ import annotations

from radixlm.hicache.controller import CacheController
from radixlm.hicache.hiradix_cache import HiMatchResult, HiRadixCache, build_hiradix_cache
from radixlm.hicache.host_pool import HostKVPool
from radixlm.hicache.host_tier import LOAD_BACK_THRESHOLD, WRITE_POLICIES, HiTreeNode, HostTier

__all__ = ["CacheController", "HiMatchResult", "HiRadixCache", "HiTreeNode", "HostKVPool", "HostTier",
           "WRITE_POLICIES", "LOAD_BACK_THRESHOLD", "build_hiradix_cache"]
