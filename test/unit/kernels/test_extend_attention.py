"""The native bf16 prefill attention (extend_attention.cpp) against a float64 reference and
against torch's own bf16 SDPA error, and the cpu backend's use of it."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from radixlm.kernels.cpu import ops
from radixlm.srt.model_runner.attention.base import create_attention_backend
from radixlm.srt.model_runner.forward_batch import ForwardBatch, ForwardMode
from radixlm.srt.model_runner.kv_pool import MHATokenToKVPool, dequantize_kv, quantize_kv

pytestmark = pytest.mark.skipif(not ops.extend_attention_supported(1, 1, 64),
                                reason="library built without AVX512-BF16 (the kernel's only path)")


@pytest.fixture(autouse=True)
def _build(amx_isa: str) -> None:
    """On an AMX CPU every test runs on both paths: the native build's tiles (head dims 32 and
    64) and the AVX512-BF16 build's register tiles."""


def _reference(q, k_buf, v_buf, q_indptr, kv_indptr, kv_indices, scale):
    """float64 causal attention per request: new token i of a request with L keys and e new
    tokens sees its first L - e + i + 1 keys."""
    hq, hkv = q.shape[1], k_buf.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for b in range(q_indptr.numel() - 1):
        q0, q1 = int(q_indptr[b]), int(q_indptr[b + 1])
        slots = kv_indices[int(kv_indptr[b]):int(kv_indptr[b + 1])]
        k = k_buf[slots].double().repeat_interleave(hq // hkv, 1).transpose(0, 1)  # [Hq, L, D]
        v = v_buf[slots].double().repeat_interleave(hq // hkv, 1).transpose(0, 1)
        length, ext = slots.numel(), q1 - q0
        visible = torch.arange(length)[None, :] <= (length - ext + torch.arange(ext))[:, None]
        s = torch.einsum("thd,hld->htl", q[q0:q1].double(), k) * scale
        p = s.masked_fill(~visible, float("-inf")).softmax(-1)
        out[q0:q1] = torch.einsum("htl,hld->thd", p, v)
    return out


def _batch(prefixes, exts, hq, hkv, d, seed=0, slots=6000):
    """A bf16 pool with the batch's keys at scattered slots and NaN in every other slot (a
    kernel reading a slot it was not given shows up as NaN), q as a row-strided view."""
    g = torch.Generator().manual_seed(seed)
    k_buf = torch.full((slots, hkv, d), float("nan"), dtype=torch.bfloat16)
    v_buf = k_buf.clone()
    lens = [p + e for p, e in zip(prefixes, exts)]
    kv_indices = torch.randperm(slots, generator=g)[:sum(lens)]
    k_buf[kv_indices] = torch.randn(sum(lens), hkv, d, generator=g).to(torch.bfloat16)
    v_buf[kv_indices] = torch.randn(sum(lens), hkv, d, generator=g).to(torch.bfloat16)
    qkv = torch.randn(sum(exts), hq + 2 * hkv, d, generator=g).to(torch.bfloat16)
    q = qkv[:, :hq]  # each token's heads contiguous, rows (hq + 2 hkv) * d apart
    q_indptr = torch.tensor([0, *exts]).cumsum(0)
    kv_indptr = torch.tensor([0, *lens]).cumsum(0)
    return q, k_buf, v_buf, q_indptr, kv_indptr, kv_indices


def _sdpa_bf16_error(q, k_buf, v_buf, q_indptr, kv_indptr, kv_indices, scale, ref):
    """Largest error of torch's bf16 SDPA on the same batch: the kernel's yardstick."""
    worst = 0.0
    for b in range(q_indptr.numel() - 1):
        q0, q1 = int(q_indptr[b]), int(q_indptr[b + 1])
        slots = kv_indices[int(kv_indptr[b]):int(kv_indptr[b + 1])]
        length, ext = slots.numel(), q1 - q0
        if ext == 0:
            continue
        visible = torch.arange(length)[None, :] <= (length - ext + torch.arange(ext))[:, None]
        o = F.scaled_dot_product_attention(q[q0:q1].transpose(0, 1)[None], k_buf[slots].transpose(0, 1)[None],
                                           v_buf[slots].transpose(0, 1)[None], attn_mask=visible, scale=scale,
                                           enable_gqa=True)[0].transpose(0, 1)
        worst = max(worst, (o.double() - ref[q0:q1]).abs().max().item())
    return worst


@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (8, 2, 128), (4, 4, 32), (6, 1, 96), (2, 1, 256)])
@pytest.mark.parametrize("prefixes,exts", [
    ([0], [1]),                     # a one-token prompt
    ([0], [200]),                   # a fresh prompt: causal only, ragged last block and row tile
    ([300], [77]),                  # a cached prefix (unmasked) then a causal diagonal
    ([0, 45, 7, 1000, 3], [70, 1, 0, 65, 130]),  # mixed: a decode row, an empty request, long context
])
def test_matches_float64_reference_as_closely_as_torch_bf16(hq, hkv, d, prefixes, exts):
    batch = _batch(prefixes, exts, hq, hkv, d)
    scale = d ** -0.5
    out = ops.extend_attention(*batch, scale)
    assert out is not None and out.dtype == torch.bfloat16 and out.shape == batch[0].shape
    ref = _reference(*batch, scale)
    err = (out.double() - ref).abs()
    # The largest error is the output's own bf16 rounding; allow twice torch's SDPA error plus
    # half an ulp at 2. On average (where a wrong key or a lost block would show), P rounded to
    # bf16 costs ~1.4x the rounding of the exact result: allow 2x.
    assert err.max().item() <= 2 * _sdpa_bf16_error(*batch, scale, ref) + 8e-3, err.max().item()
    assert err.mean().item() <= 2 * (ref.bfloat16().double() - ref).abs().mean().item(), err.mean().item()


@pytest.mark.parametrize("ramp", [1.0, -1.0])
def test_a_running_maximum_that_keeps_rising_rescales_what_is_already_summed(ramp):
    """Keys aligned ever more (or less) with the queries: scores that climb by ~60 in log2
    units along the context, so each row's running maximum passes the lazy-rescaling
    threshold (8) again and again after many blocks are already in acc and l."""
    batch = _batch([400], [150], 9, 3, 64, seed=3)
    q, k_buf, v_buf, q_indptr, kv_indptr, kv_indices = batch
    g = torch.Generator().manual_seed(4)
    u = torch.randn(64, generator=g)
    q.copy_((0.5 * u + 0.1 * torch.randn(q.shape, generator=g)).to(torch.bfloat16))
    length = kv_indices.numel()
    step = torch.linspace(0.0, 10.0, length) if ramp > 0 else torch.linspace(10.0, 0.0, length)
    k_buf[kv_indices] = (step[:, None, None] * u + 0.1 * torch.randn(length, 3, 64, generator=g)).to(torch.bfloat16)
    scale = 0.125
    out = ops.extend_attention(*batch, scale)
    ref = _reference(*batch, scale)
    err = (out.double() - ref).abs()
    assert err.max().item() <= 2 * _sdpa_bf16_error(*batch, scale, ref) + 8e-3, err.max().item()
    assert err.mean().item() <= 2 * (ref.bfloat16().double() - ref).abs().mean().item() + 1e-4, err.mean().item()


def test_every_mix_of_wide_and_32_key_blocks_in_the_pipeline():
    """attend_rows takes a row tile's keys in 128-key blocks, then 32-key ones, computing each
    block's weights while the next block's scores are: requests whose last rows end at every
    residue of 128 (no block at all past the first, only wide blocks, only 32-key ones, and each
    mix), each against the float64 reference."""
    prefixes = list(range(0, 400, 9))
    exts = [4] * len(prefixes)
    batch = _batch(prefixes, exts, 9, 3, 64, seed=5, slots=12000)
    out = ops.extend_attention(*batch, 0.125)
    ref = _reference(*batch, 0.125)
    err = (out.double() - ref).abs()
    assert err.max().item() <= 2 * _sdpa_bf16_error(*batch, 0.125, ref) + 8e-3, err.max().item()
    assert err.mean().item() <= 2 * (ref.bfloat16().double() - ref).abs().mean().item(), err.mean().item()


def test_request_groups_under_a_small_pack_budget_give_the_same_output():
    batch = _batch([0, 500, 64, 10], [100, 90, 300, 33], 9, 3, 64, seed=1)
    whole = ops.extend_attention(*batch, 0.125)
    # 1 byte: every request is its own group (a group always takes at least one request).
    for budget in (1, 300 * 1024):
        assert torch.equal(ops.extend_attention(*batch, 0.125, pack_budget_bytes=budget), whole)


def test_an_int8_pool_attends_as_its_bf16_dequantization_does():
    """The int8 KV cache's rows are dequantized while packing, exactly as kv_pool.dequantize_kv
    gives them to the torch path: the output is bit-identical to the kernel over that bf16 pool."""
    q, k_buf, v_buf, q_indptr, kv_indptr, kv_indices = _batch([0, 300, 20], [150, 77, 1], 9, 3, 64, seed=3)
    k_buf, v_buf = k_buf.nan_to_num(0.0), v_buf.nan_to_num(0.0)
    (k8, ks), (v8, vs) = quantize_kv(k_buf), quantize_kv(v_buf)
    out = ops.extend_attention(q, k8, v8, q_indptr, kv_indptr, kv_indices, 0.125, k_scale=ks, v_scale=vs)
    deq = ops.extend_attention(q, dequantize_kv(k8, ks, torch.bfloat16), dequantize_kv(v8, vs, torch.bfloat16),
                               q_indptr, kv_indptr, kv_indices, 0.125)
    assert out is not None and torch.equal(out, deq)
    # One scale without the other, or scales of the wrong shape: refused.
    assert ops.extend_attention(q, k8, v8, q_indptr, kv_indptr, kv_indices, 0.125, k_scale=ks) is None
    assert ops.extend_attention(q, k8, v8, q_indptr, kv_indptr, kv_indices, 0.125, k_scale=ks[:5],
                                v_scale=vs[:5]) is None


def test_rejects_what_it_cannot_do():
    q, k_buf, v_buf, q_indptr, kv_indptr, kv_indices = _batch([4], [8], 4, 2, 64)
    assert ops.extend_attention(q.float(), k_buf.float(), v_buf.float(), q_indptr, kv_indptr, kv_indices, 1.0) is None
    assert ops.extend_attention(q[:, :3], k_buf, v_buf, q_indptr, kv_indptr, kv_indices, 1.0) is None  # 3 % 2
    assert ops.extend_attention(q, k_buf, v_buf, q_indptr.int(), kv_indptr, kv_indices, 1.0) is None
    # More new tokens than keys: no causal offset exists.
    assert ops.extend_attention(q, k_buf, v_buf, q_indptr, torch.tensor([0, 5]), kv_indices, 1.0) is None
    assert not ops.extend_attention_supported(4, 2, 80)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_cpu_backend_prefills_long_extends_on_the_kernel(kv_cache_dtype):
    """Chunked prefill through the backend: a 150-token chunk, then a 100-token chunk over it
    (cached prefix) with a second, fresh request, each against the float64 reference over
    what the pool holds (an int8 pool's dequantized rows)."""
    hq, hkv, d, cap = 9, 3, 64, 1024
    if kv_cache_dtype == "int8" and not ops.decode_int8_supported(hq, hkv, d):
        pytest.skip("no int8 KV kernels in this build")
    pool = MHATokenToKVPool(cap, 1, hkv, d, torch.bfloat16, "cpu", kv_cache_dtype=kv_cache_dtype)
    backend = create_attention_backend("cpu", pool, hq, hkv, d)
    assert backend.native_extend
    req_to_token = torch.zeros((4, 512), dtype=torch.int64)
    g = torch.Generator().manual_seed(2)
    free = (torch.randperm(cap - 1, generator=g) + 1).tolist()
    history: dict[int, int] = {}
    for rows, exts in (([0], [150]), ([0, 1], [100, 90])):
        prefixes = [history.get(r, 0) for r in rows]
        n = sum(exts)
        loc = torch.tensor([free.pop() for _ in range(n)])
        start = 0
        for r, p, e in zip(rows, prefixes, exts):
            req_to_token[r, p:p + e] = loc[start:start + e]
            history[r] = p + e
            start += e
        q = torch.randn(n, hq, d, generator=g).to(torch.bfloat16)
        k = torch.randn(n, hkv, d, generator=g).to(torch.bfloat16)
        v = torch.randn(n, hkv, d, generator=g).to(torch.bfloat16)
        fb = ForwardBatch.build(ForwardMode.EXTEND, [0] * n, loc, rows, prefixes, exts, req_to_token)
        backend.init_forward_metadata(fb)
        assert type(fb.attn_metadata).__name__ == "_NativeExtend"
        out = backend.forward(q, k, v, 0, fb, d ** -0.5)
        lens = [p + e for p, e in zip(prefixes, exts)]
        keys = torch.cat([req_to_token[r, :n_keys] for r, n_keys in zip(rows, lens)])
        k_buf, v_buf = pool.get_kv(0)
        if pool.quantized:  # the reference reads what was stored, dequantized as the torch path does
            k_buf = dequantize_kv(k_buf, pool.k_scale[0], torch.bfloat16)
            v_buf = dequantize_kv(v_buf, pool.v_scale[0], torch.bfloat16)
        else:
            assert torch.equal(k_buf[loc], k) and torch.equal(v_buf[loc], v)
        ref = _reference(q, k_buf, v_buf, torch.tensor([0, *exts]).cumsum(0), torch.tensor([0, *lens]).cumsum(0),
                         keys, d ** -0.5)
        torch.testing.assert_close(out.double(), ref, atol=3e-2, rtol=3e-2)
