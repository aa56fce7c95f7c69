"""The int8 KV cache kernels (radixlm/kernels/cpu/kv_int8_ops.cpp): the store against
kv_pool.quantize_kv (bit for bit) and decode attention against plain torch over the
dequantized pool."""
from __future__ import annotations

import pytest
import torch

from radixlm.kernels.cpu import ops
from radixlm.srt.model_runner.kv_pool import dequantize_kv, quantize_kv

pytestmark = [pytest.mark.skipif(not ops.available(), reason="native CPU kernels could not be built"),
              pytest.mark.usefixtures("kernel_isa")]
needs_int8 = pytest.mark.skipif(not ops.decode_int8_supported(1, 1, 64),
                                reason="library built without the int8 decode kernel (needs AVX2 or AVX512-VNNI)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads,dim", [(1, 16), (3, 64), (2, 80), (8, 128)])
def test_store_kv_int8_matches_quantize_kv(dtype, kv_heads, dim):
    g = torch.Generator().manual_seed(kv_heads * dim)
    n, slots = 37, 200
    # k and v as strided views of a fused qkv output, as the model hands them over
    qkv = (torch.randn(n, 4 + 2 * kv_heads, dim, generator=g) * 3).to(dtype)
    k, v = qkv[:, 4:4 + kv_heads], qkv[:, 4 + kv_heads:]
    k[0] = 0  # all-zero rows: scale 0, values 0
    v[1, 0] = 0
    k_buf = torch.full((slots, kv_heads, dim), 7, dtype=torch.int8)
    v_buf = k_buf.clone()
    k_scale = torch.full((slots, kv_heads), -1.0)
    v_scale = k_scale.clone()
    loc = torch.randperm(slots - 1, generator=g)[:n] + 1
    assert ops.store_kv_int8(k, v, k_buf, v_buf, k_scale, v_scale, loc)
    for buf, scale, x in ((k_buf, k_scale, k), (v_buf, v_scale, v)):
        ref_q, ref_s = quantize_kv(x)
        assert torch.equal(buf[loc], ref_q)
        assert torch.equal(scale[loc], ref_s)
    untouched = torch.ones(slots, dtype=torch.bool)
    untouched[loc] = False
    assert (k_buf[untouched] == 7).all() and (k_scale[untouched] == -1).all()
    assert k_scale[loc[0], 0] == 0 and (k_buf[loc[0]] == 0).all()


def test_quantize_kv_rounds_and_bounds():
    x = torch.tensor([[[1.0, -0.5, 0.25, -2.0]]])
    q, s = quantize_kv(x)
    assert s.item() == pytest.approx(2.0 / 127)
    assert q.tolist() == [[[64, -32, 16, -127]]]  # 63.5 rounds half to even
    assert (dequantize_kv(q, s, torch.float32) - x).abs().max() <= s.item() / 2


def _reference(q, k_buf, v_buf, k_scale, v_scale, indptr, indices, scale):
    """Attention over the dequantized pool with the query quantized per head as the kernel
    does (so only float rounding separates the two)."""
    qq, qs = quantize_kv(q)
    qf = dequantize_kv(qq, qs, torch.float32)
    k_all = dequantize_kv(k_buf, k_scale, torch.float32)
    v_all = dequantize_kv(v_buf, v_scale, torch.float32)
    grp = q.shape[1] // k_buf.shape[1]
    outs, lses = [], []
    for i in range(q.shape[0]):
        slots = indices[indptr[i]:indptr[i + 1]]
        k = k_all[slots].repeat_interleave(grp, 1)
        v = v_all[slots].repeat_interleave(grp, 1)
        s = torch.einsum("hd,thd->ht", qf[i], k) * scale
        lses.append(torch.logsumexp(s, -1))
        outs.append(torch.einsum("ht,thd->hd", s.softmax(-1), v))
    return torch.stack(outs), torch.stack(lses)


@needs_int8
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 4, 64), (9, 3, 64), (8, 1, 128), (16, 2, 128), (32, 2, 256)])
@pytest.mark.parametrize("lens", [[1], [16, 17], [1, 2, 31, 128, 129], [700], [5, 1000, 3]])
def test_decode_attention_int8_matches_reference(dtype, heads, kv_heads, dim, lens):
    """Every block/chunk boundary (16, 128 keys), long requests split across threads (700,
    1000 keys at batch 1-3), grouped-query layouts with one or several KV heads per task."""
    g = torch.Generator().manual_seed(len(lens) * 1000 + heads * 10 + dim)
    slots = 2500
    k_buf = torch.randint(-127, 128, (slots, kv_heads, dim), generator=g, dtype=torch.int8)
    v_buf = torch.randint(-127, 128, (slots, kv_heads, dim), generator=g, dtype=torch.int8)
    k_scale = torch.rand(slots, kv_heads, generator=g) * 0.02 + 0.001
    v_scale = torch.rand(slots, kv_heads, generator=g) * 0.02 + 0.001
    indptr = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int64)
    indices = torch.randint(1, slots, (int(indptr[-1]),), generator=g)
    qkv = torch.randn(len(lens), heads + 2 * kv_heads, dim, generator=g).to(dtype)
    q = qkv[:, :heads]
    lse = torch.empty(len(lens), heads)
    out = ops.decode_attention_int8(q, k_buf, v_buf, k_scale, v_scale, indptr, indices, dim ** -0.5, lse=lse)
    ref, ref_lse = _reference(q, k_buf, v_buf, k_scale, v_scale, indptr, indices, dim ** -0.5)
    assert out is not None and out.dtype == dtype and out.shape == q.shape
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)


@needs_int8
def test_decode_attention_int8_error_against_float_keys_is_small():
    """Against attention over the original float K/V (before the pool quantized them): the
    int8 pool and query cost ~1% of the output's scale on random data."""
    g = torch.Generator().manual_seed(11)
    slots, kv_heads, heads, dim = 400, 3, 9, 64
    k = torch.randn(slots, kv_heads, dim, generator=g)
    v = torch.randn(slots, kv_heads, dim, generator=g)
    kq, ks = quantize_kv(k)
    vq, vs = quantize_kv(v)
    lens = [50, 300]
    indptr = torch.tensor([0, 50, 350], dtype=torch.int64)
    indices = torch.randint(1, slots, (350,), generator=g)
    q = torch.randn(2, heads, dim, generator=g)
    out = ops.decode_attention_int8(q, kq, vq, ks, vs, indptr, indices, dim ** -0.5)
    ref = []
    for i in range(len(lens)):
        slots_i = indices[indptr[i]:indptr[i + 1]]
        kk = k[slots_i].repeat_interleave(3, 1)
        vv = v[slots_i].repeat_interleave(3, 1)
        s = torch.einsum("hd,thd->ht", q[i], kk) * dim ** -0.5
        ref.append(torch.einsum("ht,thd->hd", s.softmax(-1), vv))
    ref = torch.stack(ref)
    assert ((out - ref).norm() / ref.norm()).item() < 0.02


def test_decode_attention_int8_rejects_what_it_cannot_do():
    kv = torch.zeros(10, 1, 80, dtype=torch.int8)
    scale = torch.ones(10, 1)
    indptr = torch.tensor([0, 1])
    idx = torch.tensor([1])
    assert not ops.decode_int8_supported(4, 1, 80)  # head_dim 80 is not instantiated
    assert ops.decode_attention_int8(torch.randn(1, 4, 80), kv, kv, scale, scale, indptr, idx, 0.1) is None
    kv64 = torch.zeros(10, 1, 64, dtype=torch.int8)
    assert ops.decode_attention_int8(torch.randn(1, 20, 64), kv64, kv64, scale, scale, indptr, idx, 0.1) is None
    assert ops.decode_attention_int8(torch.randn(1, 4, 64).half(), kv64, kv64, scale, scale, indptr, idx,
                                     0.1) is None
    assert not ops.store_kv_int8(torch.randn(1, 1, 64), torch.randn(1, 1, 64), kv64.float(), kv64.float(), scale,
                                 scale, torch.tensor([1]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_dequant_matches_dequantize_kv(dtype):
    """The native gather behind kv_pool.gather_kv: bit-identical to the torch formulation."""
    g = torch.Generator().manual_seed(12)
    q_buf = torch.randint(-127, 128, (300, 3, 64), generator=g, dtype=torch.int8)
    scale = torch.rand(300, 3, generator=g) * 0.1
    scale[5] = 0
    index = torch.randint(0, 300, (77,), generator=g)
    index[0] = 5
    out = ops.gather_dequant_int8(q_buf, scale, index, dtype)
    assert out is not None and out.dtype == dtype and out.shape == (77, 3, 64)
    assert torch.equal(out, dequantize_kv(q_buf[index], scale[index], dtype))
    assert ops.gather_dequant_int8(q_buf, scale, index.int(), dtype) is None  # int32 index: torch path
    assert ops.gather_dequant_int8(q_buf, scale, index, torch.float16) is None


@needs_int8
@pytest.mark.parametrize("gap", [5.0, 40.0, 75.0, 200.0])
def test_decode_attention_int8_chunks_far_below_the_maximum(gap):
    """One key of the first 128-key chunk scores `gap` nats above all the others: the later
    chunks' probabilities are tiny (e^-75) or 0 in float32 (e^-200) against the running
    maximum, and the output still matches the reference without NaN."""
    g = torch.Generator().manual_seed(int(gap))
    slots, kv_heads, heads, dim, n = 400, 1, 2, 64, 300
    k_buf = torch.randint(-127, 128, (slots, kv_heads, dim), generator=g, dtype=torch.int8)
    v_buf = torch.randint(-127, 128, (slots, kv_heads, dim), generator=g, dtype=torch.int8)
    k_scale = torch.full((slots, kv_heads), 1e-4)
    v_scale = torch.rand(slots, kv_heads, generator=g) * 0.02 + 0.001
    q = torch.randn(1, heads, dim, generator=g)
    q[0, 1] = q[0, 0]  # both heads see the same gap
    indices = torch.arange(1, n + 1)
    top = int(indices[3])
    k_buf[top, 0] = torch.where(q[0, 0] >= 0, 127, -127).to(torch.int8)
    qq, qs = quantize_kv(q)
    dot = (dequantize_kv(qq, qs, torch.float32)[0, 0] * k_buf[top, 0].float()).sum() * dim ** -0.5
    k_scale[top, 0] = gap / dot.item()
    indptr = torch.tensor([0, n], dtype=torch.int64)
    lse = torch.empty(1, heads)
    out = ops.decode_attention_int8(q, k_buf, v_buf, k_scale, v_scale, indptr, indices, dim ** -0.5, lse=lse)
    ref, ref_lse = _reference(q, k_buf, v_buf, k_scale, v_scale, indptr, indices, dim ** -0.5)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)
