"""Shared builders for the radix cache tests: real pools, real Req objects.

(A plain module rather than fixtures, so other test packages, e.g. the scheduler's, can import it.)
"""
from __future__ import annotations

import itertools

import torch

from radixlm.core import Req, SamplingParams
from radixlm.radix_cache.base import BasePrefixCache
from radixlm.radix_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
from radixlm.radix_cache.no_cache import NoPrefixCache
from radixlm.radix_cache.radix_cache import RadixCache, RadixKey

_rids = itertools.count()


def build_cache(capacity: int = 64, page_size: int = 1, policy: str = "lru", req_slots: int = 4,
                max_context_len: int = 64, disabled: bool = False) -> BasePrefixCache:
    pool = ReqToTokenPool(req_slots, max_context_len)
    alloc = TokenToKVPoolAllocator(capacity)
    cls = NoPrefixCache if disabled else RadixCache
    return cls(pool, alloc, page_size=page_size, eviction_policy=policy)


def make_req(prompt: list[int], extra_key: str | None = None, priority: int = 0) -> Req:
    return Req(rid=f"r{next(_rids)}", origin_input_ids=list(prompt), sampling_params=SamplingParams(),
               extra_key=extra_key, priority=priority)


def admit(cache: BasePrefixCache, req: Req) -> int:
    """What the scheduler does at admission: match, lock, take a request slot, copy the prefix."""
    m = cache.match_prefix(RadixKey(req.fill_ids, req.extra_key))
    idx = cache.req_to_token_pool.alloc()
    assert idx is not None
    cache.inc_lock_ref(m.last_node)
    n = len(m.device_indices)
    cache.req_to_token_pool.req_to_token[idx, :n] = m.device_indices
    req.req_pool_idx, req.last_node = idx, m.last_node
    req.cache_protected_len = req.kv_committed_len = req.kv_allocated_len = req.prefix_len = n
    return n


def extend(cache: BasePrefixCache, req: Req, n_alloc: int, n_write: int | None = None) -> torch.Tensor:
    """Allocate `n_alloc` more slots for the request and mark `n_write` of them computed."""
    slots = cache.allocator.alloc(n_alloc)
    assert slots is not None, "test pool too small"
    row = cache.req_to_token_pool.req_to_token[req.req_pool_idx]
    row[req.kv_allocated_len:req.kv_allocated_len + n_alloc] = slots
    req.kv_allocated_len += n_alloc
    req.kv_committed_len += n_alloc if n_write is None else n_write
    return slots
