"""CacheManager.extend_each (a decode step's slots in one allocation) against extend(req, 1)
per request: the same slots in the same order, the same table rows and lengths; and no
change at all when the pool cannot give every request its slot."""
from __future__ import annotations

import torch

from radixlm.core import Req
from radixlm.radix_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
from radixlm.radix_cache.radix_cache import RadixCache
from radixlm.sampling_params import SamplingParams
from radixlm.scheduler.cache_manager import CacheManager


def _setup(capacity: int) -> tuple[CacheManager, list[Req]]:
    cache = CacheManager(RadixCache(), ReqToTokenPool(4, 32), TokenToKVPoolAllocator(capacity))
    reqs = []
    for i, n in enumerate([3, 1, 5]):
        req = Req(rid=f"r{i}", origin_input_ids=[7] * n, sampling_params=SamplingParams())
        req.req_pool_idx = i
        assert cache.extend(req, n) is not None  # a prompt's slots, allocated one request at a time
        reqs.append(req)
    return cache, reqs


def test_extend_each_equals_one_extend_per_request():
    a, ra = _setup(20)
    b, rb = _setup(20)
    got = a.extend_each(ra)
    want = torch.cat([b.extend(r, 1) for r in rb])
    assert torch.equal(got, want)
    assert [r.kv_allocated_len for r in ra] == [r.kv_allocated_len for r in rb] == [4, 2, 6]
    assert torch.equal(a.req_to_token_pool.req_to_token, b.req_to_token_pool.req_to_token)
    assert a.available() == b.available() == 20 - 12
    for r, loc in zip(ra, got.tolist(), strict=True):  # each request's new slot sits at its end
        assert a.req_to_token_pool.req_to_token[r.req_pool_idx, r.kv_allocated_len - 1].item() == loc


def test_extend_each_without_room_changes_nothing():
    cache, reqs = _setup(10)  # 9 slots held, 1 free: three requests need 3
    table = cache.req_to_token_pool.req_to_token.clone()
    assert cache.extend_each(reqs) is None
    assert [r.kv_allocated_len for r in reqs] == [3, 1, 5]
    assert torch.equal(cache.req_to_token_pool.req_to_token, table)
    assert cache.available() == 1
