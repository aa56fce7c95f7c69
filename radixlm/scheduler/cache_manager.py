"""The scheduler's single owner of KV bookkeeping: admission, allocation, and the one exit.

Every stop — finish, abort, retract — calls `release(req, insert=...)`. The radix tree does
the actual work (`cache_finished_req`); this module only decides *when* and guarantees it
happens once per admission.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from radixlm.core import Req
from radixlm.radix_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
from radixlm.radix_cache.radix_cache import RadixKey

logger = logging.getLogger(__name__)


@dataclass
class PrefixMatch:
    indices: torch.Tensor
    last_node: object
    # HiCache: tokens matched in host-only nodes past `last_node`, the deepest of them, and how
    # many of `indices` were just loaded back from the host tier.
    host_hit_length: int = 0
    last_host_node: object = None
    loaded: int = 0

    def __len__(self) -> int:
        return int(self.indices.numel())


class CacheManager:
    def __init__(self, tree, req_to_token_pool: ReqToTokenPool, allocator: TokenToKVPoolAllocator,
                 page_size: int = 1) -> None:
        self.tree = tree
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.page_size = page_size
        self.evicted_tokens_total = 0
        # prompt tokens of admitted requests, and how many of them hit each tier (HiCache metrics)
        self.hit_stats = {"admitted_tokens": 0, "device_hit_tokens": 0, "host_hit_tokens": 0}

    # ---------------------------------------------------------------- sizes
    @property
    def capacity(self) -> int:
        return self.allocator.capacity

    def available(self) -> int:
        return self.allocator.available_size()

    def evictable(self) -> int:
        # HiCache: tokens pinned only by in-flight host copies count too, because eviction
        # waits for those copies when it runs short (admission would otherwise stall on them).
        return self.tree.evictable_size() + self.tree.copy_pinned_size()

    def protected(self) -> int:
        return self.tree.protected_size()

    def memory_stats(self) -> dict[str, int]:
        return {"capacity": self.capacity, "free": self.available(),
                "evictable": self.tree.evictable_size(), "protected": self.protected()}

    # ---------------------------------------------------------------- admission
    def match(self, req: Req) -> PrefixMatch:
        """Longest cached prefix usable by `req`; at least one token is always left to compute
        so the request gets logits for its next token."""
        fill = req.fill_ids
        limit = len(fill) - 1
        if req.return_logprob and req.logprob_start_len >= 0 and not req.output_ids:
            # The logprob of prompt token s comes from position s - 1's hidden state, so input
            # logprobs from s need positions s - 1 onwards computed (SGLang stops the match at
            # s and reports token s as None; we compute it).
            limit = min(limit, max(req.logprob_start_len - 1, 0))
        if limit <= 0:
            return PrefixMatch(torch.empty(0, dtype=torch.int64), self.tree.root)
        res = self.tree.match_prefix(RadixKey(fill[:limit], req.extra_key))
        return PrefixMatch(res.device_indices, res.last_node, res.host_hit_length, res.last_host_node)

    # ---------------------------------------------------------------- HiCache
    def load_back(self, match: PrefixMatch, quota: int) -> PrefixMatch:
        """Load the host-resident continuation of `match` to the device (all or nothing, at most
        `quota` tokens); returns the longer match, or `match` when nothing was loaded."""
        loaded = self.tree.load_back(match.last_host_node, quota)
        if loaded is None:
            return match
        return PrefixMatch(torch.cat([match.indices, loaded]), match.last_host_node, loaded=int(loaded.numel()))

    def note_admission(self, req: Req, match: PrefixMatch) -> None:
        self.hit_stats["admitted_tokens"] += len(req.fill_ids)
        self.hit_stats["device_hit_tokens"] += len(match) - match.loaded
        self.hit_stats["host_hit_tokens"] += match.loaded

    def hicache_stats(self) -> dict | None:
        stats = self.tree.hicache_stats()
        if stats is None:
            return None
        h = self.hit_stats
        total = max(h["admitted_tokens"], 1)
        return {**stats, **h, "device_hit_rate": round(h["device_hit_tokens"] / total, 4),
                "host_hit_rate": round(h["host_hit_tokens"] / total, 4)}

    def lock(self, node) -> None:
        self.tree.inc_lock_ref(node)

    def unlock(self, node) -> None:
        self.tree.dec_lock_ref(node)

    def alloc_tokens(self, n: int) -> torch.Tensor | None:
        """Allocate n KV slots, evicting unlocked cache leaves when the free list is short."""
        if n == 0:
            return torch.empty(0, dtype=torch.int64)
        self.make_room(n)
        return self.allocator.alloc(n)

    def make_room(self, n: int) -> bool:
        """Evict unlocked cache leaves until n slots are free; whether that succeeded."""
        short = n - self.available()
        if short > 0:
            self.evicted_tokens_total += self.tree.evict(short)
        return self.available() >= n

    def start_request(self, req: Req, match: PrefixMatch) -> bool:
        """Bind `req` to a request slot with the matched prefix already locked by the caller."""
        idx = self.req_to_token_pool.alloc()
        if idx is None:
            return False
        n = len(match)
        req.req_pool_idx = idx
        req.last_node = match.last_node
        req.prefix_len = n
        req.cache_protected_len = n
        req.kv_committed_len = n
        req.kv_allocated_len = n
        if n:
            self.req_to_token_pool.req_to_token[idx, :n] = match.indices
        return True

    def extend(self, req: Req, num_tokens: int) -> torch.Tensor | None:
        """Allocate KV for the next `num_tokens` tokens of `req` (after its committed ones)."""
        loc = self.alloc_tokens(num_tokens)
        if loc is None:
            return None
        start = req.kv_allocated_len
        self.req_to_token_pool.req_to_token[req.req_pool_idx, start:start + num_tokens] = loc
        req.kv_allocated_len = start + num_tokens
        return loc

    # ---------------------------------------------------------------- after a forward
    def commit(self, req: Req, num_tokens: int) -> None:
        req.kv_committed_len += num_tokens
        assert req.kv_committed_len <= req.kv_allocated_len

    def cache_prefill(self, req: Req) -> None:
        """Publish a request's computed prompt KV in the tree so others (and its own later
        chunks) can share it; the request keeps a lock on it."""
        self.tree.cache_unfinished_req(req)

    # ---------------------------------------------------------------- the one exit
    def release(self, req: Req, insert: bool = True) -> None:
        """Return every KV slot and the request slot `req` holds, exactly once.

        insert=True publishes the computed tokens in the tree (finish, client abort,
        retract); insert=False frees them (errors)."""
        if req.req_pool_idx is None:
            return  # never admitted, or already released: nothing held
        self.tree.cache_finished_req(req, insert=insert and not req.kv_poisoned)

    def flush(self) -> None:
        self.tree.reset()
        self.req_to_token_pool.clear()
        self.allocator.clear()

    def check_integrity(self, live_reqs: list[Req]) -> None:
        self.tree.check_integrity([r for r in live_reqs if r.req_pool_idx is not None])
