"""The CPU KV pool is in memory once built: no decode step pays for its pages' first touch.

Slots are handed out in order through the whole pool, so a lazily backed pool made one step
in every ~5,000 tokens of a 135M model fault a fresh 2 MiB page in each of its 60 buffers
at once (~300 ms on this project's 2-core VM): every running request stalled and every
abort waited for it (docs/cancel_chain.md, Latency).
"""
from __future__ import annotations

import ctypes
import mmap
import sys

import pytest
import torch

from radixlm.srt.model_runner.kv_pool import MHATokenToKVPool

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore(2) is Linux's")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]


def resident_fraction(t: torch.Tensor) -> float:
    """Share of the tensor's pages that are in memory (mincore's low bit per page)."""
    page = mmap.PAGESIZE
    start = t.data_ptr() // page * page
    end = t.data_ptr() + t.numel() * t.element_size()
    n = (end - start + page - 1) // page
    vec = (ctypes.c_ubyte * n)()
    assert _libc.mincore(start, end - start, vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec) / n


@pytest.mark.parametrize("hugepages", ["1", "0"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_every_page_of_the_pool_is_resident_after_allocation(monkeypatch, hugepages, kv_cache_dtype):
    monkeypatch.setenv("RADIXLM_HUGEPAGES", hugepages)
    # 40,000 slots x 2 heads x 64 dims: 10 MiB per bf16 buffer, past the huge-page threshold
    # and past glibc's mmap threshold (a fresh mapping, not reused heap)
    pool = MHATokenToKVPool(40_000, num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16,
                            kv_cache_dtype=kv_cache_dtype)
    for buf in pool.slot_buffers():
        assert resident_fraction(buf) == 1.0
        assert not buf.any()  # written whole, with zeros


def test_a_pool_brought_back_after_release_is_resident_again():
    pool = MHATokenToKVPool(40_000, num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
    pool.release()
    pool.allocate()
    assert all(resident_fraction(b) == 1.0 for b in pool.slot_buffers())
