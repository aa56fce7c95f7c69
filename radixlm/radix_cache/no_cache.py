"""`NoPrefixCache`: the prefix-cache contract with no sharing (`--disable-radix-cache`).

Matching always returns the empty prefix at a root that is never locked, inserting stores
nothing, and eviction finds nothing. The cache manager sees `disabled` and frees a request's
whole row on release, so `cache_protected_len` stays 0 and the scheduler runs the same code
with or without the tree.
"""
from __future__ import annotations

import torch

from radixlm.radix_cache.prefix_cache import (
    EMPTY_SLOTS,
    PREFIX_CACHES,
    DeviceKV,
    LockHolder,
    MatchResult,
    PrefixCache,
    PrefixCacheConfig,
    RadixKey,
    TreeNode,
)

__all__ = ["NoPrefixCache"]


class NoPrefixCache(PrefixCache):
    def __init__(self, page_size: int = 1) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.reset()

    @property
    def disabled(self) -> bool:
        return True

    def reset(self) -> None:
        self.root = TreeNode(key=RadixKey([]), value=EMPTY_SLOTS, lock_ref=1)

    def match(self, key: RadixKey, *, count_hit: bool = True) -> MatchResult:
        return MatchResult(EMPTY_SLOTS.clone(), self.root)

    def insert(self, key: RadixKey, value: torch.Tensor, priority: int = 0) -> int:
        return 0  # nothing stored, nothing was present

    def lock(self, node: TreeNode | None) -> int:
        self._check_node(node)
        return 0

    def unlock(self, node: TreeNode | None) -> int:
        self._check_node(node)
        return 0

    def _check_node(self, node: TreeNode | None) -> None:
        if node is not None and node is not self.root:
            raise RuntimeError(f"NoPrefixCache got a node it never handed out: {node!r}")

    def evict(self, num_tokens: int) -> torch.Tensor:
        return EMPTY_SLOTS.clone()

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def path_indices(self, node: TreeNode) -> torch.Tensor:
        self._check_node(node)
        return EMPTY_SLOTS.clone()

    def device_slots(self) -> torch.Tensor:
        return EMPTY_SLOTS.clone()

    def check_integrity(self, holders: list[LockHolder]) -> None:
        for who, node in holders:
            assert node is None or node is self.root, f"{who} locks {node!r}, which the disabled cache never handed out"

    def pretty_print(self) -> str:
        text = "NoPrefixCache (radix cache disabled)"
        print(text)
        return text


@PREFIX_CACHES.register("none")
def _build(config: PrefixCacheConfig, device: DeviceKV) -> NoPrefixCache:
    return NoPrefixCache(config.page_size)
