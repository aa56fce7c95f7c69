"""The native bf16 prefill attention with a sliding window (extend_attention.cpp, window > 0)
against a float64 reference: the new token at key position p sees keys p - W < j <= p only.

Windows from 1 key to wider than the request, cached prefixes shorter and longer than the
window, group sizes 1-8, one or several row tiles per token block; every slot the kernel is not
given holds NaN, and so do the prefix's keys before the window, so a key read outside the window
shows up as NaN. Without a window the output is bit for bit the unwindowed call's."""
from __future__ import annotations

import pytest
import torch

from radixlm.kernels.cpu import ops

pytestmark = pytest.mark.skipif(not ops.extend_attention_supported(1, 1, 64),
                                reason="library built without AVX512-BF16 (the kernel's only path)")


@pytest.fixture(autouse=True)
def _build(amx_isa: str) -> None:
    """On an AMX CPU every test runs on both paths (tiles for head dims 32 and 64, and registers)."""


def _reference(q, k_buf, v_buf, q_indptr, kv_indptr, kv_indices, scale, window):
    hq, hkv = q.shape[1], k_buf.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for b in range(q_indptr.numel() - 1):
        q0, q1 = int(q_indptr[b]), int(q_indptr[b + 1])
        slots = kv_indices[int(kv_indptr[b]):int(kv_indptr[b + 1])]
        length, ext = slots.numel(), q1 - q0
        pos = (length - ext + torch.arange(ext))[:, None]
        kpos = torch.arange(length)[None, :]
        visible = (kpos <= pos) & (kpos > pos - window)
        k = k_buf[slots].double().nan_to_num(0.0).repeat_interleave(hq // hkv, 1).transpose(0, 1)
        v = v_buf[slots].double().nan_to_num(0.0).repeat_interleave(hq // hkv, 1).transpose(0, 1)
        s = torch.einsum("thd,hld->htl", q[q0:q1].double(), k) * scale
        out[q0:q1] = torch.einsum("htl,hld->thd", s.masked_fill(~visible, float("-inf")).softmax(-1), v)
    return out


def _batch(prefixes, exts, hq, hkv, d, window, seed=0, slots=8000):
    """Keys at scattered slots, NaN elsewhere and in every key no new token's window reaches."""
    g = torch.Generator().manual_seed(seed)
    k_buf = torch.full((slots, hkv, d), float("nan"), dtype=torch.bfloat16)
    v_buf = k_buf.clone()
    lens = [p + e for p, e in zip(prefixes, exts)]
    kv_indices = torch.randperm(slots, generator=g)[:sum(lens)]
    k_buf[kv_indices] = torch.randn(sum(lens), hkv, d, generator=g).to(torch.bfloat16)
    v_buf[kv_indices] = torch.randn(sum(lens), hkv, d, generator=g).to(torch.bfloat16)
    start = 0
    for p, n in zip(prefixes, lens):
        dead = max(0, p + 1 - window)  # keys before the first new token's window
        k_buf[kv_indices[start:start + dead]] = float("nan")
        v_buf[kv_indices[start:start + dead]] = float("nan")
        start += n
    qkv = torch.randn(sum(exts), hq + 2 * hkv, d, generator=g).to(torch.bfloat16)
    q_indptr = torch.tensor([0, *exts]).cumsum(0)
    kv_indptr = torch.tensor([0, *lens]).cumsum(0)
    return qkv[:, :hq], k_buf, v_buf, q_indptr, kv_indptr, kv_indices


CASES = [
    # (prefixes, new tokens, hq, hkv, d, window)
    ([0], [200], 4, 4, 64, 8),
    ([0, 37, 300], [70, 130, 5], 8, 2, 64, 1),
    ([0, 37, 300], [70, 130, 5], 8, 2, 64, 17),
    ([250, 3], [100, 260], 6, 2, 128, 64),
    ([90], [260], 8, 1, 64, 129),
    ([10, 500], [40, 33], 4, 2, 32, 100),
    ([0, 20], [50, 30], 2, 2, 256, 1000),  # wider than every request: the causal answer
    ([1000], [150], 16, 2, 96, 300),
]


@pytest.mark.parametrize("prefixes,exts,hq,hkv,d,window", CASES)
def test_windowed_extend_matches_float64(prefixes, exts, hq, hkv, d, window):
    q, k_buf, v_buf, q_indptr, kv_indptr, kv_indices = _batch(prefixes, exts, hq, hkv, d, window)
    scale = d ** -0.5
    out = ops.extend_attention(q, k_buf, v_buf, q_indptr, kv_indptr, kv_indices, scale, window=window)
    assert out is not None and not out.isnan().any()
    ref = _reference(q, k_buf, v_buf, q_indptr, kv_indptr, kv_indices, scale, window)
    # bf16 q, K, V as given; P rounded to bf16 before P @ V (about 2^-8 relative).
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=0)


def test_small_pack_budget_splits_requests():
    """Requests packed one at a time (a budget below one request) give the same answer."""
    q, k_buf, v_buf, q_indptr, kv_indptr, kv_indices = _batch([40, 300, 0], [90, 50, 120], 8, 2, 64, 24, seed=3)
    whole = ops.extend_attention(q, k_buf, v_buf, q_indptr, kv_indptr, kv_indices, 0.125, window=24)
    split = ops.extend_attention(q, k_buf, v_buf, q_indptr, kv_indptr, kv_indices, 0.125, pack_budget_bytes=1,
                                 window=24)
    assert whole is not None and split is not None and torch.equal(whole, split)


def test_no_window_is_the_causal_kernel_bit_for_bit():
    q, k_buf, v_buf, q_indptr, kv_indptr, kv_indices = _batch([0, 70], [150, 90], 8, 2, 64, 10**9, seed=5)
    plain = ops.extend_attention(q, k_buf, v_buf, q_indptr, kv_indptr, kv_indices, 0.125)
    wide = ops.extend_attention(q, k_buf, v_buf, q_indptr, kv_indptr, kv_indices, 0.125, window=10**9)
    assert plain is not None and wide is not None and torch.equal(plain, wide)
    assert ops.extend_attention(q, k_buf, v_buf, q_indptr, kv_indptr, kv_indices, 0.125, window=0) is None
