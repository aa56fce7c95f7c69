"""Shared builders for the radix cache tests: real pools, a real prefix cache under a real cache
manager (the only caller of the pools), real Req objects.

(A plain module rather than fixtures, so other test packages, e.g. the scheduler's, can import it.)
"""
from __future__ import annotations

import itertools

import torch

from radixlm.core import Req, SamplingParams
from radixlm.radix_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
from radixlm.radix_cache.no_cache import NoPrefixCache
from radixlm.radix_cache.prefix_cache import PrefixCache, RadixKey
from radixlm.radix_cache.radix_cache import RadixCache
from radixlm.scheduler.cache_manager import CacheManager, PrefixMatch

_rids = itertools.count()


def build_cache(capacity: int = 64, page_size: int = 1, policy: str = "lru", req_slots: int = 4,
                max_context_len: int = 64, disabled: bool = False) -> CacheManager:
    pool = ReqToTokenPool(req_slots, max_context_len)
    alloc = TokenToKVPoolAllocator(capacity)
    tree: PrefixCache = NoPrefixCache(page_size) if disabled else RadixCache(page_size, policy)
    return CacheManager(tree, pool, alloc)


def make_req(prompt: list[int], extra_key: str | None = None, priority: int = 0) -> Req:
    return Req(rid=f"r{next(_rids)}", origin_input_ids=list(prompt), sampling_params=SamplingParams(),
               extra_key=extra_key, priority=priority)


def admit(cache: CacheManager, req: Req) -> int:
    """Admission of the whole prompt's match: lock it, take a request slot, copy the prefix."""
    m = cache.prefix.match(RadixKey(req.fill_ids, req.extra_key))
    assert cache.admit(req, PrefixMatch(m.device_indices, m.last_node))
    return len(m)


def extend(cache: CacheManager, req: Req, n_alloc: int, n_write: int | None = None) -> torch.Tensor:
    """Allocate `n_alloc` more slots for the request and mark `n_write` of them computed."""
    slots = cache.extend(req, n_alloc)
    assert slots is not None, "test pool too small"
    cache.commit(req, n_alloc if n_write is None else n_write)
    return slots
