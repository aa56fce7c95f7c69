"""`NoPrefixCache`: the prefix cache interface with no sharing (`--disable-radix-cache`).

Matching always returns the empty prefix at a root node that is never locked, inserting stores
nothing, and every KV slot of a request stays the request's until `cache_finished_req` frees
`row[0:kv_allocated_len]`. So `cache_protected_len` is always 0 and the scheduler runs the same
code path with or without the tree.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from radixlm.radix_cache.base import PREFIX_CACHES, BasePrefixCache
from radixlm.radix_cache.radix_cache import MatchResult, RadixKey, TreeNode

if TYPE_CHECKING:
    from radixlm.core import Req
    from radixlm.radix_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator

__all__ = ["NoPrefixCache"]


class NoPrefixCache(BasePrefixCache):
    def __init__(
        self,
        req_to_token_pool: "ReqToTokenPool",
        allocator: "TokenToKVPoolAllocator",
        page_size: int = 1,
        eviction_policy: str = "lru",  # accepted (and ignored) so both caches build alike
    ) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.page_size = page_size
        self.reset()

    @property
    def disabled(self) -> bool:
        return True

    def reset(self) -> None:
        self.root = TreeNode(key=RadixKey([]), value=torch.empty((0,), dtype=torch.int64), lock_ref=1)

    def match_prefix(self, key: RadixKey) -> MatchResult:
        return MatchResult(device_indices=torch.empty((0,), dtype=torch.int64), last_node=self.root)

    def insert(self, key: RadixKey, value: torch.Tensor, priority: int = 0) -> int:
        # Nothing is stored and nothing was present: the caller keeps (and later frees) its slots.
        return 0

    def inc_lock_ref(self, node: TreeNode | None) -> int:
        self._check_node(node)
        return 0

    def dec_lock_ref(self, node: TreeNode | None) -> int:
        self._check_node(node)
        return 0

    def _check_node(self, node: TreeNode | None) -> None:
        if node is not None and node is not self.root:
            raise RuntimeError(f"NoPrefixCache got a node it never handed out: {node!r}")

    def evict(self, num_tokens: int) -> int:
        return 0

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def pretty_print(self) -> str:
        text = "NoPrefixCache (radix cache disabled)"
        print(text)
        return text

    def cache_unfinished_req(self, req: "Req") -> None:
        # Everything stays owned by the request; only validate that it still holds its row.
        self._req_row(req)

    def cache_finished_req(self, req: "Req", insert: bool = True) -> None:
        row = self._req_row(req)
        if req.cache_protected_len != 0:
            raise RuntimeError(f"request {req.rid!r}: cache_protected_len "
                               f"{req.cache_protected_len} with the cache disabled")
        self._check_node(req.last_node)
        self.allocator.free(row[:req.kv_allocated_len].clone())
        self._release_req_slot(req)

    def check_integrity(self, live_reqs: list["Req"]) -> None:
        from radixlm.radix_cache.integrity import check_no_cache

        check_no_cache(self, live_reqs)


PREFIX_CACHES.register("none")(NoPrefixCache)
