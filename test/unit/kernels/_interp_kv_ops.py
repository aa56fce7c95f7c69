"""KV store and page-copy kernels against their torch twins (TRITON_INTERPRET=1)."""
from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run via test_interpreter.py (needs TRITON_INTERPRET=1)", allow_module_level=True)
pytest.importorskip("triton")

from radixlm.kernels.kv_ops import BufferTable, gather_rows, scatter_rows, store_kv  # noqa: E402
from radixlm.kernels.page_copy import PageCopier  # noqa: E402
from radixlm.kernels.reference import gather_rows_ref, scatter_rows_ref, store_kv_ref  # noqa: E402


@pytest.mark.parametrize("pool_dtype,src_dtype", [(torch.float32, torch.float32),
                                                  (torch.float16, torch.float32),
                                                  (torch.float16, torch.float16)])
@pytest.mark.parametrize("kv_heads,head_dim", [(2, 64), (3, 128)])
def test_store_kv_matches_reference(pool_dtype, src_dtype, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(kv_heads * head_dim)
    pool = [torch.randn(40, kv_heads, head_dim, generator=gen).to(pool_dtype) for _ in range(2)]
    expect = [b.clone() for b in pool]
    loc = torch.randperm(39, generator=gen)[:11] + 1
    # k, v as the model produces them: slices of a fused qkv tensor (row stride > row size).
    qkv = torch.randn(11, 4 + 2 * kv_heads, head_dim, generator=gen).to(src_dtype)
    k, v = qkv[:, 4:4 + kv_heads], qkv[:, 4 + kv_heads:]
    store_kv(pool[0], pool[1], loc, k, v, block=64)  # block < row: several chunks per row
    store_kv_ref(expect[0], expect[1], loc, k, v)
    assert torch.equal(pool[0], expect[0]) and torch.equal(pool[1], expect[1])


def test_store_kv_empty_and_bad_rows():
    k_buf = torch.zeros(8, 2, 16)
    store_kv(k_buf, k_buf.clone(), torch.empty(0, dtype=torch.int64), torch.empty(0, 2, 16),
             torch.empty(0, 2, 16))
    assert torch.equal(k_buf, torch.zeros(8, 2, 16))
    with pytest.raises(ValueError):
        store_kv(k_buf, k_buf.clone(), torch.tensor([1]), torch.zeros(1, 2, 8), torch.zeros(1, 2, 8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gather_scatter_rows_match_reference(dtype):
    gen = torch.Generator().manual_seed(5)
    bufs = [torch.randn(30, 2, 64, generator=gen).to(dtype) for _ in range(6)]  # 3 layers x K/V
    table = BufferTable(bufs)
    slots = torch.tensor([29, 3, 17, 4, 1])
    got = gather_rows(table, slots, block=32)
    assert torch.equal(got, gather_rows_ref(bufs, slots))
    src = torch.randn(6, 5, 2, 64, generator=gen).to(dtype)
    expect = [b.clone() for b in bufs]
    scatter_rows(table, slots, src, block=32)
    scatter_rows_ref(expect, slots, src)
    assert all(torch.equal(a, b) for a, b in zip(bufs, expect))
    assert gather_rows(table, torch.empty(0, dtype=torch.int64)).shape == (6, 0, 2, 64)


def test_buffer_table_rejects_mismatched_buffers():
    with pytest.raises(ValueError):
        BufferTable([torch.zeros(4, 2, 8), torch.zeros(5, 2, 8)])
    with pytest.raises(ValueError):
        scatter_rows(BufferTable([torch.zeros(4, 2, 8)]), torch.tensor([1]), torch.zeros(1, 2, 2, 8))


@pytest.mark.parametrize("use_triton", [True, False])
def test_page_copier_round_trip(use_triton):
    gen = torch.Generator().manual_seed(9)
    layers, kv_heads, head_dim = 2, 2, 64
    dev = [torch.randn(50, kv_heads, head_dim, generator=gen) for _ in range(2 * layers)]
    host = [torch.zeros(80, kv_heads, head_dim) for _ in range(2 * layers)]
    copier = PageCopier(dev, host, use_triton=use_triton)
    dev_slots, host_slots = torch.tensor([7, 8, 9, 40, 2]), torch.tensor([70, 1, 33, 34, 5])
    copier.device_to_host(dev_slots, host_slots)
    for d, h in zip(dev, host):
        assert torch.equal(h[host_slots], d[dev_slots])
    original = [d.clone() for d in dev]
    back = torch.tensor([11, 12, 13, 14, 15])
    copier.host_to_device(host_slots, back)
    for d, o in zip(dev, original):
        assert torch.equal(d[back], o[dev_slots])
        untouched = torch.ones(50, dtype=torch.bool)
        untouched[back] = False
        assert torch.equal(d[untouched], o[untouched])
