"""Decode and extend attention kernels against their torch twins (TRITON_INTERPRET=1).

Run through test_interpreter.py. Pools are NaN-filled except the slots a request owns,
and slots are scattered in random order, so a kernel that reads an unowned slot or
mixes up index order fails loudly. Small blocks (16) force several blocks and splits
per request even at these small lengths.
"""
from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run via test_interpreter.py (needs TRITON_INTERPRET=1)", allow_module_level=True)
pytest.importorskip("triton")

from radixlm.kernels.decode_attention import choose_num_kv_splits, decode_attention_fwd  # noqa: E402
from radixlm.kernels.extend_attention import extend_attention_fwd  # noqa: E402
from radixlm.kernels.indices import build_indptr  # noqa: E402
from radixlm.kernels.reference import decode_attention_ref, extend_attention_ref  # noqa: E402

TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=1e-2, rtol=1e-2)}


def make_pool(num_kv_heads: int, head_dim: int, owned: int, dtype: torch.dtype, gen: torch.Generator):
    """A pool with `owned` random rows at scattered slots; every other slot is NaN."""
    size = owned + 37
    k_buf = torch.full((size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    v_buf = torch.full_like(k_buf, float("nan"))
    slots = torch.randperm(size - 1, generator=gen)[:owned] + 1
    k_buf[slots] = torch.randn(owned, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_buf[slots] = torch.randn(owned, num_kv_heads, head_dim, generator=gen).to(dtype)
    return k_buf, v_buf, slots


# (num_heads, num_kv_heads): GQA ratios 1, 3 and 8.
HEADS = [(4, 4), (6, 2), (8, 1)]


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_matches_reference(heads, head_dim):
    num_heads, num_kv_heads = heads
    gen = torch.Generator().manual_seed(num_heads * 1000 + head_dim)
    lens = torch.tensor([1, 2, 17, 77])  # mixed: a lone token, short, odd, several blocks
    k_buf, v_buf, slots = make_pool(num_kv_heads, head_dim, int(lens.sum()), torch.float32, gen)
    indptr = build_indptr(lens)
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen)
    ref = decode_attention_ref(q, k_buf, v_buf, indptr, slots, head_dim ** -0.5)
    assert torch.isfinite(ref).all()
    # 1 split; 3 splits (the length-1 and length-2 requests get empty splits); 8 > blocks.
    for splits in (1, 3, 8):
        out = decode_attention_fwd(q, k_buf, v_buf, indptr, slots, head_dim ** -0.5,
                                   num_kv_splits=splits, block_n=16)
        torch.testing.assert_close(out, ref, **TOL[torch.float32], msg=f"splits={splits}")


def test_decode_logit_cap_and_int64_indptr():
    gen = torch.Generator().manual_seed(7)
    lens = torch.tensor([5, 40])
    k_buf, v_buf, slots = make_pool(2, 64, int(lens.sum()), torch.float32, gen)
    indptr = build_indptr(lens, torch.int64)
    q = torch.randn(2, 6, 64, generator=gen) * 4  # large logits so the cap bites
    ref = decode_attention_ref(q, k_buf, v_buf, indptr, slots, 0.125, logit_cap=3.0)
    out = decode_attention_fwd(q, k_buf, v_buf, indptr, slots, 0.125, logit_cap=3.0, num_kv_splits=2,
                               block_n=16)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])
    uncapped = decode_attention_ref(q, k_buf, v_buf, indptr, slots, 0.125)
    assert (uncapped - ref).abs().max() > 1e-3  # the cap changed something


def test_decode_zero_length_request_gives_zeros():
    gen = torch.Generator().manual_seed(3)
    lens = torch.tensor([0, 9])
    k_buf, v_buf, slots = make_pool(1, 64, 9, torch.float32, gen)
    q = torch.randn(2, 3, 64, generator=gen)
    out = decode_attention_fwd(q, k_buf, v_buf, build_indptr(lens), slots, 0.125, num_kv_splits=2,
                               block_n=16)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    torch.testing.assert_close(out, decode_attention_ref(q, k_buf, v_buf, build_indptr(lens), slots, 0.125))


def test_decode_float16():
    gen = torch.Generator().manual_seed(11)
    lens = torch.tensor([3, 50])
    k_buf, v_buf, slots = make_pool(2, 64, int(lens.sum()), torch.float16, gen)
    q = torch.randn(2, 6, 64, generator=gen).half()
    indptr = build_indptr(lens)
    out = decode_attention_fwd(q, k_buf, v_buf, indptr, slots, 0.125, num_kv_splits=2, block_n=16)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out, decode_attention_ref(q, k_buf, v_buf, indptr, slots, 0.125),
                               **TOL[torch.float16])


def test_choose_num_kv_splits():
    assert choose_num_kv_splits(1, 8, 10, block_n=64) == 1  # one block: nothing to split
    assert choose_num_kv_splits(1, 8, 4096, block_n=64, max_splits=16, target_programs=256) == 16
    assert choose_num_kv_splits(128, 8, 4096, block_n=64, target_programs=256) == 1  # grid full
    assert choose_num_kv_splits(0, 8, 0) == 1


def run_extend(num_heads, num_kv_heads, head_dim, prefix, ext, dtype=torch.float32, seed=0,
               logit_cap=0.0, block=16):
    gen = torch.Generator().manual_seed(seed)
    prefix_t, ext_t = torch.tensor(prefix), torch.tensor(ext)
    k_buf, v_buf, slots = make_pool(num_kv_heads, head_dim, int(prefix_t.sum()), dtype, gen)
    t = int(ext_t.sum())
    q = torch.randn(t, num_heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(t, num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(t, num_kv_heads, head_dim, generator=gen).to(dtype)
    qo, pre = build_indptr(ext_t), build_indptr(prefix_t)
    scale = head_dim ** -0.5
    out = extend_attention_fwd(q, k, v, k_buf, v_buf, qo, pre, slots, max(ext), scale, logit_cap,
                               block_m=block, block_n=block)
    ref = extend_attention_ref(q, k, v, k_buf, v_buf, qo, pre, slots, scale, logit_cap)
    assert torch.isfinite(ref).all()
    torch.testing.assert_close(out, ref, **TOL[dtype])


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_extend_matches_reference(heads, head_dim):
    # Prefix lengths 0 (empty-prefix request inside a batch), 1, odd, long (several
    # blocks); extend lengths mixed, including a single token and a multi-block one.
    run_extend(*heads, head_dim, prefix=[0, 1, 7, 45], ext=[5, 1, 19, 3], seed=head_dim + heads[0])


def test_extend_no_prefix_batch_and_long_prefix():
    run_extend(6, 2, 64, prefix=[0, 0, 0], ext=[33, 2, 17], seed=1)  # plain prefill
    run_extend(8, 8, 64, prefix=[150], ext=[4], seed=2)  # chunked prefill: long prefix, short chunk


def test_extend_logit_cap_float16_and_default_blocks():
    run_extend(6, 2, 64, prefix=[9, 0], ext=[6, 20], seed=3, logit_cap=2.0)
    run_extend(6, 2, 64, prefix=[9, 31], ext=[6, 20], dtype=torch.float16, seed=4)
    run_extend(4, 2, 64, prefix=[70, 3], ext=[70, 1], seed=5, block=64)  # GPU-sized blocks
