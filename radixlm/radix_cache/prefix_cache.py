"""The prefix-cache contract: token ids in; KV slot indices and node handles out.

The cache manager (`radixlm/scheduler/cache_manager.py`) is the only caller. A prefix cache never
sees a request and never calls an allocator:
- `match(key)` returns the KV slots of the longest cached prefix and a handle (`TreeNode`) to its
  end;
- `insert(key, value)` takes the caller's slots for the tokens it does not hold yet and returns how
  many leading tokens it already had (the caller frees its own slots for those);
- `lock(node)` / `unlock(node)` pin the path to a handle while a request reads it;
- `evict(n)` gives up unlocked leaves and returns their slots, for the caller to free.

Implementations: `RadixCache` (the tree), `NoPrefixCache` (`--disable-radix-cache`) and
`HiRadixCache` (the tree over a host tier, `radixlm/hicache`), built by name from
`PREFIX_CACHES` (the command line's choices come from it too). A lower tier's operations
(`poll`, `before_forward`, `load_back`, ...) have no-op defaults here, so the manager calls
them whatever cache it holds.
"""
from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from radixlm.rank_sync import LOCAL_RANK, RankSync
from radixlm.registry import Registry

__all__ = ["RadixKey", "TreeNode", "MatchResult", "LockHolder", "SlotAllocator", "PrefixCache",
           "PrefixCacheConfig", "DeviceKV", "PREFIX_CACHES", "EMPTY_SLOTS"]

EMPTY_SLOTS = torch.empty((0,), dtype=torch.int64)
_node_ids = itertools.count()


class RadixKey:
    """Token ids plus a namespace: keys with different `extra_key` (LoRA, cache salt,
    weight version) never share a node, even for identical tokens."""

    __slots__ = ("token_ids", "extra_key")

    def __init__(self, token_ids: Sequence[int] | torch.Tensor, extra_key: str | None = None) -> None:
        # Matching compares list slices at C speed; a tuple or tensor would never compare equal.
        if isinstance(token_ids, torch.Tensor):
            token_ids = token_ids.tolist()
        self.token_ids: list[int] = token_ids if isinstance(token_ids, list) else list(token_ids)
        self.extra_key = extra_key

    def __repr__(self) -> str:
        return f"RadixKey({self.token_ids!r}, extra_key={self.extra_key!r})"

    def __len__(self) -> int:
        return len(self.token_ids)

    def __getitem__(self, s: slice) -> RadixKey:
        if not isinstance(s, slice):
            raise TypeError("RadixKey supports slicing only")
        return RadixKey(self.token_ids[s], self.extra_key)


@dataclass(eq=False, slots=True)
class TreeNode:
    """A run of tokens (`key`) and the KV slots computed for them (`value`). eq=False: nodes
    are hashed by identity (they live in sets and heaps)."""

    key: RadixKey
    value: torch.Tensor | None  # int64 KV slot indices; None once the device copy is gone
    parent: TreeNode | None = None
    children: dict[Any, TreeNode] = field(default_factory=dict)
    lock_ref: int = 0
    last_access_time: int = 0
    creation_time: int = 0
    hit_count: int = 0
    priority: int = 0
    id: int = field(default_factory=lambda: next(_node_ids))

    @property
    def evicted(self) -> bool:
        return self.value is None

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(id={self.id}, len={len(self.key)}, "
                f"extra_key={self.key.extra_key!r}, lock_ref={self.lock_ref})")


@dataclass
class MatchResult:
    device_indices: torch.Tensor  # int64, the KV slots of the matched prefix
    last_node: TreeNode  # deepest matched node (root when nothing matched)

    def __len__(self) -> int:
        return int(self.device_indices.numel())


# Who holds a lock, for the integrity checks' messages: ("request 'r1'", node).
LockHolder = tuple[str, "TreeNode | None"]
# Hands out n device KV slots (making room if it can), or None: the cache manager's, lent to a
# lower tier for its load-back so that the manager stays the only caller of the allocator.
SlotAllocator = Callable[[int], "torch.Tensor | None"]


class PrefixCache(ABC):
    page_size: int
    root: TreeNode

    @property
    def disabled(self) -> bool:
        """True when the cache never takes or shares KV (every slot stays its request's)."""
        return False

    def page_align(self, n: int) -> int:
        return n // self.page_size * self.page_size

    # ---- the contract ----
    @abstractmethod
    def match(self, key: RadixKey, *, count_hit: bool = True) -> MatchResult:
        """Longest cached page-aligned prefix of `key`. count_hit=False for the manager's own
        re-match after an insert (finding one's own tokens is not a reuse)."""

    @abstractmethod
    def insert(self, key: RadixKey, value: torch.Tensor, priority: int = 0) -> int:
        """Take `value`'s slots for the page-aligned tokens of `key` not held yet; return how
        many leading tokens were held already."""

    @abstractmethod
    def lock(self, node: TreeNode | None) -> int:
        """Pin `node` and its ancestors; returns the tokens moved evictable -> protected."""

    @abstractmethod
    def unlock(self, node: TreeNode | None) -> int:
        """Unpin; returns the tokens moved protected -> evictable."""

    @abstractmethod
    def evict(self, num_tokens: int) -> torch.Tensor:
        """Give up unlocked leaves until `num_tokens` slots are freed (or nothing is left);
        returns the freed device slots."""

    @abstractmethod
    def evictable_size(self) -> int: ...

    @abstractmethod
    def protected_size(self) -> int: ...

    def total_size(self) -> int:
        return self.evictable_size() + self.protected_size()

    @abstractmethod
    def reset(self) -> None:
        """Drop everything (the caller clears the pools)."""

    @abstractmethod
    def path_indices(self, node: TreeNode) -> torch.Tensor:
        """KV slots from the root down to `node` (what a holder of `node` relies on)."""

    @abstractmethod
    def device_slots(self) -> torch.Tensor:
        """Every device slot the cache holds (for the slot-ownership check)."""

    @abstractmethod
    def check_integrity(self, holders: list[LockHolder]) -> None:
        """The cache's own invariants (shape, counters, locks == `holders` plus its own);
        raises AssertionError naming the node."""

    @abstractmethod
    def pretty_print(self) -> str: ...

    # ---- a lower tier (HiCache overrides these; radixlm/hicache) ----
    def poll(self) -> None:
        """Top of every scheduler iteration (HiCache: start queued copies, process acks)."""

    def before_forward(self) -> None:
        """On the forward thread, right before a forward (HiCache: wait for the loads)."""

    def copy_pinned_size(self) -> int:
        """Tokens locked only by in-flight copies (evictable once they land)."""
        return 0

    def load_back(self, match: MatchResult, quota: int, alloc: SlotAllocator) -> MatchResult:
        """Bring the lower-tier continuation of `match` back to the device (at most `quota`
        tokens, slots from `alloc`); returns the longer match, or `match` itself."""
        return match

    def drain(self) -> None:
        """Wait for every copy in flight and process its ack."""

    def tier_stats(self) -> dict[str, Any] | None:
        """Metrics of a lower tier, or None without one."""
        return None

    def prefetch_ready(self, key: RadixKey, owner: str) -> bool:
        """Whether the waiting request `owner` (prompt `key`) may be admitted now (HiCache's
        storage tier: False while its prefetch policy waits for pages being read)."""
        return True


@dataclass(frozen=True)
class PrefixCacheConfig:
    """What building a prefix cache needs (from ServerArgs.prefix_cache_config)."""

    kind: str = "radix"  # a PREFIX_CACHES name: radix | none | hiradix
    page_size: int = 1
    eviction_policy: str = "lru"
    # HiCache (kind "hiradix")
    hicache_ratio: float = 2.0
    hicache_size_gb: float = 0.0
    hicache_write_policy: str = "write_through"
    # HiCache storage tier (radixlm/hicache/storage_tier.py); None: no storage tier
    hicache_storage_backend: str | None = None
    hicache_storage_dir: str = ""
    hicache_storage_backend_extra_config: str = ""  # JSON (the mooncake backend's settings)
    hicache_storage_prefetch_policy: str = "best_effort"
    hicache_storage_prefetch_threshold: int = 256
    hicache_storage_prefetch_timeout: float = 2.0
    storage_model_id: str = ""  # the model's identity, part of every storage key


@dataclass
class DeviceKV:
    """The device side a lower tier mirrors: the KV pool's capacity and its per-slot buffers
    (or a function returning the live ones: memory release/resume swaps the tensors)."""

    capacity: int
    buffers: list[torch.Tensor] | Callable[[], list[torch.Tensor]] = field(default_factory=list)
    copy_hook: Callable[[str], None] | None = None  # tests slow or hold a copy with it
    min_free_bytes: int | None = None  # RAM a host tier must leave (None: its default)
    # How tensor-parallel ranks agree on which copies are done (one rank: as they are); rank_sync.py.
    ranks: RankSync = LOCAL_RANK


# Factories by name, each `(config, device) -> PrefixCache`, filled by the implementing modules on
# import; `radixlm.scheduler.cache_manager.build_prefix_cache` imports them all and picks one.
PREFIX_CACHES: Registry[Callable[[PrefixCacheConfig, DeviceKV], PrefixCache]] = Registry("prefix cache")

