"""`BasePrefixCache`: the contract the scheduler codes against.

Two implementations: `RadixCache` (the prefix tree) and `NoPrefixCache`
(`--disable-radix-cache`). The scheduler never checks which one it holds.

KV ownership of a live request (see `radixlm.core`): `row[0:cache_protected_len]` belongs to
the cache (locked through `req.last_node`), `row[cache_protected_len:kv_allocated_len]` belongs
to the request. `cache_finished_req` is the ONE function that returns a request's KV: finish,
abort and retract differ only in `insert`.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Callable

import torch

from radixlm.registry import Registry

if TYPE_CHECKING:
    from radixlm.core import Req
    from radixlm.radix_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
    from radixlm.radix_cache.radix_cache import MatchResult, RadixKey, TreeNode

__all__ = ["BasePrefixCache", "PREFIX_CACHES", "create_prefix_cache"]


class BasePrefixCache(ABC):
    req_to_token_pool: "ReqToTokenPool"
    allocator: "TokenToKVPoolAllocator"
    page_size: int

    # ---- tree operations ----
    @abstractmethod
    def match_prefix(self, key: "RadixKey") -> "MatchResult": ...

    @abstractmethod
    def insert(self, key: "RadixKey", value: torch.Tensor, priority: int = 0) -> int: ...

    @abstractmethod
    def inc_lock_ref(self, node: "TreeNode | None") -> int: ...

    @abstractmethod
    def dec_lock_ref(self, node: "TreeNode | None") -> int: ...

    @abstractmethod
    def evict(self, num_tokens: int) -> int: ...

    @abstractmethod
    def evictable_size(self) -> int: ...

    @abstractmethod
    def protected_size(self) -> int: ...

    def total_size(self) -> int:
        return self.evictable_size() + self.protected_size()

    @abstractmethod
    def reset(self) -> None: ...

    @abstractmethod
    def pretty_print(self) -> str: ...

    # ---- request-level operations ----
    @abstractmethod
    def cache_unfinished_req(self, req: "Req") -> None: ...

    @abstractmethod
    def cache_finished_req(self, req: "Req", insert: bool = True) -> None: ...

    @abstractmethod
    def check_integrity(self, live_reqs: list["Req"]) -> None: ...

    # ---- host tier hooks (HiCache overrides them; radixlm/hicache) ----
    def check_events(self) -> None:
        """Called at the top of every scheduler iteration (HiCache: process copy acks)."""

    def hicache_stats(self) -> dict | None:
        """Host-tier metrics, or None without a host tier."""
        return None

    def copy_pinned_size(self) -> int:
        """Tokens locked only by in-flight host copies (evictable once they land)."""
        return 0

    @property
    def disabled(self) -> bool:
        """True when the cache never shares KV (the scheduler may skip prefix matching)."""
        return False

    # ---- shared helpers ----
    def page_align(self, n: int) -> int:
        return n // self.page_size * self.page_size

    def _req_row(self, req: "Req") -> torch.Tensor:
        """The request's row of req_to_token, after checking its KV lengths are consistent.

        Raises instead of guessing: a release on a request that holds no row is a second
        release, and a second release would free slots someone else now owns.
        """
        if req.req_pool_idx is None:
            raise RuntimeError(
                f"request {req.rid!r} holds no request slot: its KV was already released "
                "(or it was never admitted)")
        cpl, committed, allocated = req.cache_protected_len, req.kv_committed_len, req.kv_allocated_len
        if not 0 <= cpl <= committed <= allocated <= self.req_to_token_pool.max_context_len:
            raise RuntimeError(
                f"request {req.rid!r} has inconsistent KV lengths: cache_protected_len={cpl} "
                f"kv_committed_len={committed} kv_allocated_len={allocated} "
                f"max_context_len={self.req_to_token_pool.max_context_len}")
        if committed > len(req.origin_input_ids) + len(req.output_ids):
            raise RuntimeError(
                f"request {req.rid!r}: kv_committed_len={committed} exceeds its {req.seqlen} tokens")
        return self.req_to_token_pool.req_to_token[req.req_pool_idx]

    def _release_req_slot(self, req: "Req") -> None:
        """Return the request slot and forget the per-admission KV fields (after the KV itself
        was handed back), so that a second release raises in `_req_row`."""
        assert req.req_pool_idx is not None
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = None
        req.last_node = None
        req.cache_protected_len = 0
        req.kv_committed_len = 0
        req.kv_allocated_len = 0


# Factories by name: "radix" and "none". Filled by the implementing modules on import;
# `create_prefix_cache` imports them so callers need not.
PREFIX_CACHES: Registry[Callable[..., BasePrefixCache]] = Registry("prefix cache")


def create_prefix_cache(
    req_to_token_pool: "ReqToTokenPool",
    allocator: "TokenToKVPoolAllocator",
    page_size: int = 1,
    eviction_policy: str = "lru",
    disable_radix_cache: bool = False,
    **kwargs: Any,
) -> BasePrefixCache:
    # Imported here (not at module top) because both modules import this one.
    import radixlm.radix_cache.no_cache  # noqa: F401
    import radixlm.radix_cache.radix_cache  # noqa: F401

    name = "none" if disable_radix_cache else kwargs.pop("backend", "radix")
    factory = PREFIX_CACHES.get(name)
    return factory(req_to_token_pool, allocator, page_size=page_size,
                   eviction_policy=eviction_policy, **kwargs)
