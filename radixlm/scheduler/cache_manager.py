"""The one owner of KV bookkeeping: the only writer of a request's KV fields and the only caller
of the allocators (request slots and KV slots).

A request's KV state is lengths over its row of the request-to-token table (see radixlm/core.py):
`[0, cache_protected_len)` the prefix cache's (locked through `last_node`),
`[cache_protected_len, kv_allocated_len)` the request's own. The prefix cache is spoken to in
token ids, slot indices and node handles only (radixlm/radix_cache/prefix_cache.py): it never
sees a request, and the slots it gives up on `evict` come back here to be freed.

Every stop (finish, abort, retract) calls `release(req, insert=...)` once per admission: the
computed page-aligned tokens go to the prefix cache (insert=True), the rest is freed.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from radixlm.core import Req
from radixlm.radix_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
from radixlm.radix_cache.prefix_cache import (
    EMPTY_SLOTS,
    PREFIX_CACHES,
    DeviceKV,
    PrefixCache,
    PrefixCacheConfig,
    RadixKey,
    TreeNode,
)

logger = logging.getLogger(__name__)

__all__ = ["CacheManager", "PrefixMatch", "build_prefix_cache"]


def build_prefix_cache(config: PrefixCacheConfig, device: DeviceKV | None = None) -> PrefixCache:
    """The prefix cache named by `config.kind`, from PREFIX_CACHES."""
    # Imported for their registrations.
    import radixlm.hicache.hiradix_cache  # noqa: F401
    import radixlm.radix_cache.no_cache  # noqa: F401
    import radixlm.radix_cache.radix_cache  # noqa: F401

    return PREFIX_CACHES.get(config.kind)(config, device or DeviceKV(0))


@dataclass
class PrefixMatch:
    indices: torch.Tensor  # device KV slots of the usable cached prefix
    last_node: TreeNode
    loaded: int = 0  # how many of `indices` were just loaded back from a lower tier

    def __len__(self) -> int:
        return int(self.indices.numel())


class CacheManager:
    def __init__(self, prefix: PrefixCache, req_to_token_pool: ReqToTokenPool,
                 allocator: TokenToKVPoolAllocator) -> None:
        self.prefix = prefix
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.page_size = prefix.page_size
        self.evicted_tokens_total = 0
        # prompt tokens of admitted requests, and how many of them hit each tier (HiCache metrics)
        self.hit_stats = {"admitted_tokens": 0, "device_hit_tokens": 0, "host_hit_tokens": 0}

    # ---------------------------------------------------------------- sizes
    @property
    def capacity(self) -> int:
        return self.allocator.capacity

    @property
    def disabled(self) -> bool:
        return self.prefix.disabled

    def available(self) -> int:
        return self.allocator.available_size()

    def evictable(self) -> int:
        # HiCache: tokens pinned only by in-flight host copies count too, because eviction
        # waits for those copies when it runs short (admission would otherwise stall on them).
        return self.prefix.evictable_size() + self.prefix.copy_pinned_size()

    def protected(self) -> int:
        return self.prefix.protected_size()

    def memory_stats(self) -> dict[str, int]:
        return {"capacity": self.capacity, "free": self.available(),
                "evictable": self.prefix.evictable_size(), "protected": self.protected()}

    def tier_stats(self) -> dict[str, Any] | None:
        stats = self.prefix.tier_stats()
        if stats is None:
            return None
        h = self.hit_stats
        total = max(h["admitted_tokens"], 1)
        return {**stats, **h, "device_hit_rate": round(h["device_hit_tokens"] / total, 4),
                "host_hit_rate": round(h["host_hit_tokens"] / total, 4)}

    # ---------------------------------------------------------------- every iteration
    def poll(self) -> None:
        """Top of every scheduler iteration (HiCache: acks of finished host copies unlock
        their nodes)."""
        self.prefix.poll()

    def before_forward(self) -> None:
        """Right before each forward, on the thread that launches it (HiCache: wait for the
        loads the batch reads)."""
        self.prefix.before_forward()

    # ---------------------------------------------------------------- admission
    def match(self, req: Req, load_quota: int | None = None) -> PrefixMatch:
        """Longest cached prefix usable by `req`; at least one token is always left to compute
        so the request gets logits for its next token. With `load_quota`, a continuation held
        by a lower tier (HiCache) is loaded back too when it fits the quota."""
        fill = req.fill_ids
        limit = len(fill) - 1
        if req.return_logprob and req.logprob_start_len >= 0 and not req.output_ids:
            # The logprob of prompt token s comes from position s - 1's hidden state, so input
            # logprobs from s need positions s - 1 onwards computed (SGLang stops the match at
            # s and reports token s as None; we compute it).
            limit = min(limit, max(req.logprob_start_len - 1, 0))
        if limit <= 0:
            return PrefixMatch(EMPTY_SLOTS.clone(), self.prefix.root)
        m = self.prefix.match(RadixKey(fill[:limit], req.extra_key))
        on_device = len(m)
        if load_quota is not None:
            m = self.prefix.load_back(m, load_quota, self.alloc_tokens)
        return PrefixMatch(m.device_indices, m.last_node, loaded=len(m) - on_device)

    def ready(self, req: Req) -> bool:
        """Whether `req` may be admitted now: False while the prefix cache's storage tier
        prefetches its prompt and the prefetch policy says to wait."""
        return self.prefix.prefetch_ready(RadixKey(req.fill_ids, req.extra_key), req.rid)

    def lock(self, node: TreeNode) -> None:
        self.prefix.lock(node)

    def unlock(self, node: TreeNode) -> None:
        self.prefix.unlock(node)

    def admit(self, req: Req, match: PrefixMatch) -> bool:
        """Bind `req` to a request slot with the matched prefix as its cache-owned, locked part;
        False (nothing held) when no request slot is free."""
        idx = self.req_to_token_pool.alloc()
        if idx is None:
            return False
        self.prefix.lock(match.last_node)
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

    def hand_over(self, src: Req, dst: Req, keep: int) -> None:
        """`dst` continues from the first `keep` tokens of `src`'s KV (a session's next turn,
        sessions.py): `src`'s request slot, its lock and those tokens become `dst`'s, the rest
        of `src`'s own slots are freed, and `src` holds nothing afterwards (as after release).
        The tree's part of `src` stays locked, so `keep` must cover it."""
        row = self._req_row(src)
        cpl, allocated = src.cache_protected_len, src.kv_allocated_len
        if not (cpl <= keep <= src.kv_committed_len and keep < len(dst.fill_ids)
                and dst.fill_ids[:keep] == src.fill_ids[:keep]):
            raise RuntimeError(f"request {dst.rid!r} cannot continue {keep} tokens of {src.rid!r}'s KV")
        if keep < allocated:
            self.allocator.free(row[keep:allocated].clone())
        dst.req_pool_idx, dst.last_node = src.req_pool_idx, src.last_node
        dst.prefix_len = dst.kv_committed_len = dst.kv_allocated_len = keep
        dst.cache_protected_len = cpl
        dst.cached_tokens = keep  # the turn's prompt hit: the history it continues
        src.req_pool_idx = None
        src.last_node = None
        src.prefix_len = src.cache_protected_len = src.kv_committed_len = src.kv_allocated_len = 0

    def note_admission(self, req: Req, match: PrefixMatch) -> None:
        """An admission that went through: the prompt's cache hit, and the hit counters."""
        if not req.output_ids:
            req.cached_tokens = len(match)  # the prompt's cache hit, not a resume's
        self.hit_stats["admitted_tokens"] += req.seqlen
        self.hit_stats["device_hit_tokens"] += len(match) - match.loaded
        self.hit_stats["host_hit_tokens"] += match.loaded

    def alloc_tokens(self, n: int) -> torch.Tensor | None:
        """n KV slots, evicting unlocked cache leaves when the free list is short."""
        if n == 0:
            return EMPTY_SLOTS.clone()
        self.make_room(n)
        return self.allocator.alloc(n)

    def evict(self, num_tokens: int) -> int:
        """Evict at least `num_tokens` from the prefix cache if it can; returns how many."""
        freed = self.prefix.evict(num_tokens)
        self.allocator.free(freed)
        self.evicted_tokens_total += int(freed.numel())
        return int(freed.numel())

    def make_room(self, n: int) -> bool:
        """Evict unlocked cache leaves until n slots are free; whether that succeeded."""
        short = n - self.available()
        if short > 0:
            self.evict(short)
        return self.available() >= n

    def extend(self, req: Req, num_tokens: int) -> torch.Tensor | None:
        """Allocate KV for the next `num_tokens` tokens of `req` (after its allocated ones)."""
        loc = self.alloc_tokens(num_tokens)
        if loc is None:
            return None
        start = req.kv_allocated_len
        self.req_to_token_pool.req_to_token[self._idx(req), start:start + num_tokens] = loc
        req.kv_allocated_len = start + num_tokens
        return loc

    def extend_each(self, reqs: list[Req]) -> torch.Tensor | None:
        """One more KV slot for each of `reqs` (a decode step), in their order: what
        `extend(req, 1)` for each does, with one allocation and one table write. Per request
        those were ~12 us of a batch-32 decode step's Python (0.4 ms)."""
        loc = self.alloc_tokens(len(reqs))
        if loc is None:
            return None
        rows = [self._idx(req) for req in reqs]
        cols = [req.kv_allocated_len for req in reqs]
        self.req_to_token_pool.req_to_token[rows, cols] = loc
        for req in reqs:
            req.kv_allocated_len += 1
        return loc

    # ---------------------------------------------------------------- after a forward
    def slots_of(self, req: Req, start: int, n: int) -> torch.Tensor:
        """The KV slots of `req`'s tokens [start, start + n): what a KV transfer reads or writes
        (a view of its row; nobody else reaches into req_to_token)."""
        return self.req_to_token_pool.req_to_token[self._idx(req), start:start + n]

    def commit(self, req: Req, num_tokens: int) -> None:
        """`num_tokens` more of the allocated slots now hold computed KV."""
        req.kv_committed_len += num_tokens
        assert req.kv_committed_len <= req.kv_allocated_len

    def rollback(self, req: Req, num_tokens: int) -> None:
        """Give back the last `num_tokens` allocated slots (a speculative step's rejected
        drafts): freed now, never published; only uncommitted slots can go back."""
        if num_tokens == 0:
            return
        row = self._req_row(req)
        allocated = req.kv_allocated_len
        if not 0 < num_tokens <= allocated - req.kv_committed_len:
            raise RuntimeError(f"request {req.rid!r}: cannot roll back {num_tokens} slots, "
                               f"{allocated - req.kv_committed_len} are uncommitted")
        self.allocator.free(row[allocated - num_tokens:allocated].clone())
        req.kv_allocated_len = allocated - num_tokens

    def cache_prefill(self, req: Req) -> None:
        """After a prefill chunk: publish the page-aligned computed KV in the prefix cache, so
        others (and the request's own later chunks) share it, and move the request's lock down
        to the new last node. The unaligned tail stays the request's."""
        row = self._req_row(req)
        if self.prefix.disabled:
            return  # everything stays the request's
        aligned = self.prefix.page_align(req.kv_committed_len)
        key = RadixKey(req.fill_ids[:aligned], req.extra_key)
        cpl = req.cache_protected_len
        present = self.prefix.insert(key, row[:aligned], priority=req.priority)
        self._check_prefix_kept(req, present)
        if present > cpl:
            # Another request inserted these tokens meanwhile: the cache keeps its slots.
            self.allocator.free(row[cpl:present].clone())
        match = self.prefix.match(key, count_hit=False)
        assert len(match) == aligned, f"re-match after insert found {len(match)} of {aligned} tokens"
        row[cpl:aligned] = match.device_indices[cpl:]
        # Lock the new node before unlocking the old one: the shared path never becomes
        # evictable in between.
        self.prefix.lock(match.last_node)
        self.prefix.unlock(req.last_node)
        req.last_node = match.last_node
        req.cache_protected_len = aligned

    # ---------------------------------------------------------------- the one exit
    def release(self, req: Req, insert: bool = True) -> None:
        """Return every KV slot and the request slot `req` holds, exactly once: a second call
        raises instead of freeing slots someone else may own by then.

        insert=True publishes the computed tokens in the prefix cache (finish, client abort,
        retract); insert=False frees them (errors)."""
        row = self._req_row(req)
        cpl, allocated = req.cache_protected_len, req.kv_allocated_len
        # KV a failed forward may have half written is freed, never published (error_boundary.py)
        if insert and not req.kv_poisoned and not self.prefix.disabled:
            aligned = self.prefix.page_align(req.kv_committed_len)
            key = RadixKey(req.fill_ids[:aligned], req.extra_key)
            present = self.prefix.insert(key, row[:aligned], priority=req.priority)
            self._check_prefix_kept(req, present)
            to_free = [row[cpl:present], row[aligned:allocated]]
        else:
            to_free = [row[cpl:allocated]]
        self.allocator.free(torch.cat(to_free).clone())
        self.prefix.unlock(req.last_node)
        self.req_to_token_pool.free(self._idx(req))
        # Forget the per-admission fields, so that a second release raises in _req_row.
        req.req_pool_idx = None
        req.last_node = None
        req.prefix_len = 0
        req.cache_protected_len = 0
        req.kv_committed_len = 0
        req.kv_allocated_len = 0
        req.kv_poisoned = False

    def poison(self, req: Req) -> None:
        """A forward or the processing of `req` failed: the KV it holds may be half written, so
        its release frees it instead of publishing it (error_boundary.py)."""
        req.kv_poisoned = True

    def flush(self) -> None:
        self.prefix.reset()
        self.req_to_token_pool.clear()
        self.allocator.clear()

    def check_integrity(self, live_reqs: list[Req]) -> None:
        from radixlm.scheduler.cache_integrity import check_cache

        check_cache(self, [r for r in live_reqs if r.req_pool_idx is not None])

    # ---------------------------------------------------------------- helpers
    @staticmethod
    def _idx(req: Req) -> int:
        assert req.req_pool_idx is not None, f"request {req.rid!r} holds no request slot"
        return req.req_pool_idx

    def _req_row(self, req: Req) -> torch.Tensor:
        """The request's row of req_to_token, after checking its KV lengths are consistent."""
        if req.req_pool_idx is None:
            raise RuntimeError(
                f"request {req.rid!r} holds no request slot: its KV was already released "
                "(or it was never admitted)")
        cpl, committed, allocated = req.cache_protected_len, req.kv_committed_len, req.kv_allocated_len
        max_len = self.req_to_token_pool.max_context_len
        if not 0 <= cpl <= committed <= allocated <= max_len:
            raise RuntimeError(
                f"request {req.rid!r} has inconsistent KV lengths: cache_protected_len={cpl} "
                f"kv_committed_len={committed} kv_allocated_len={allocated} max_context_len={max_len}")
        if committed > req.seqlen:
            raise RuntimeError(f"request {req.rid!r}: kv_committed_len={committed} exceeds its {req.seqlen} tokens")
        return self.req_to_token_pool.req_to_token[req.req_pool_idx]

    @staticmethod
    def _check_prefix_kept(req: Req, present: int) -> None:
        # The locked prefix is in the cache, so insert must find at least that much; less
        # would mean the request's cache-owned slots get inserted a second time.
        if present < req.cache_protected_len:
            raise RuntimeError(
                f"request {req.rid!r}: insert found {present} tokens but {req.cache_protected_len} "
                "are locked in the prefix cache (lost lock or wrong fill_ids)")
