"""Decode attention with a KV prefix shared by the whole batch against the per-request path
and a float64 reference: torch_native's dense-prefix (cascade) path, and the cpu backend,
which reads every request's whole row instead (its cascade was
slower)."""
from __future__ import annotations

import pytest
import torch

from radixlm.kernels.cpu import ops as cpu_ops
from radixlm.srt.model_runner.attention.cpu import CpuNativeAttention
from radixlm.srt.model_runner.attention.torch_native import TorchNativeAttention
from radixlm.srt.model_runner.forward_batch import ForwardBatch, ForwardMode
from radixlm.srt.model_runner.kv_pool import MHATokenToKVPool

H, HKV, D = 6, 2, 16


def _reference(q, kb, vb, table, lens):
    g = H // HKV
    out = torch.empty(q.shape, dtype=torch.float64)
    for i, n in enumerate(lens):
        k = kb[table[i, :n]].double().repeat_interleave(g, dim=1)
        v = vb[table[i, :n]].double().repeat_interleave(g, dim=1)
        s = torch.einsum("hd,shd->hs", q[i].double(), k) * D ** -0.5
        out[i] = torch.einsum("hs,shd->hd", s.softmax(-1), v)
    return out


_BACKENDS = [TorchNativeAttention,
             pytest.param(CpuNativeAttention, marks=pytest.mark.skipif(
                 not cpu_ops.decode_supported(H, HKV, D), reason="no native decode kernel for this shape"))]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("suffix", [[1, 1, 1], [3, 1, 7]])
@pytest.mark.parametrize("backend_cls", _BACKENDS)
def test_shared_prefix_decode_matches_reference(dtype, tol, suffix, backend_cls):
    gen = torch.Generator().manual_seed(0)
    shared, cap = 80, 400
    pool = MHATokenToKVPool(cap, 1, HKV, D, dtype, "cpu")
    pool.k_buffer[0][1:] = torch.randn(cap, HKV, D, generator=gen).to(dtype)
    pool.v_buffer[0][1:] = torch.randn(cap, HKV, D, generator=gen).to(dtype)
    perm = torch.randperm(cap, generator=gen) + 1
    table = torch.zeros(4, 128, dtype=torch.int64)
    table[:3, :shared] = perm[:shared]  # the same slots: a radix-cached prefix
    nxt = shared
    for i, s in enumerate(suffix):
        table[i, shared:shared + s] = perm[nxt:nxt + s]
        nxt += s
    lens = [shared + s for s in suffix]
    q = torch.randn(3, H, D, generator=gen).to(dtype)
    backend = backend_cls(pool, H, HKV, D)
    loc = torch.tensor([int(table[i, n - 1]) for i, n in enumerate(lens)])
    fb = ForwardBatch.build(ForwardMode.DECODE, [0, 0, 0], loc, [0, 1, 2], [n - 1 for n in lens], [1, 1, 1],
                            table)
    backend.init_forward_metadata(fb)
    shared_index = getattr(fb.attn_metadata, "shared_index", None)
    if backend_cls is CpuNativeAttention:
        assert shared_index is None
    else:
        assert shared_index is not None and shared_index.numel() >= shared
    k_new, v_new = pool.k_buffer[0][loc].clone(), pool.v_buffer[0][loc].clone()
    out = backend.forward(q, k_new, v_new, 0, fb, D ** -0.5)
    ref = _reference(q, pool.k_buffer[0], pool.v_buffer[0], table, lens)
    assert (out.double() - ref).abs().max().item() < tol
    # The per-request path agrees as well.
    backend.min_shared_prefix = 1 << 30
    backend.init_forward_metadata(fb)
    assert getattr(fb.attn_metadata, "shared_index", None) is None
    plain = backend.forward(q, k_new, v_new, 0, fb, D ** -0.5)
    assert (plain.double() - ref).abs().max().item() < tol


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_extend_over_shared_prefix_matches_reference(dtype, tol):
    """Three requests extend (1, 4 and 9 new tokens) a cached 80-slot common prefix."""
    gen = torch.Generator().manual_seed(1)
    shared, cap, ext = 80, 400, [1, 4, 9]
    pool = MHATokenToKVPool(cap, 1, HKV, D, dtype, "cpu")
    pool.k_buffer[0][1:] = torch.randn(cap, HKV, D, generator=gen).to(dtype)
    pool.v_buffer[0][1:] = torch.randn(cap, HKV, D, generator=gen).to(dtype)
    perm = torch.randperm(cap, generator=gen) + 1
    table = torch.zeros(4, 128, dtype=torch.int64)
    table[:3, :shared] = perm[:shared]
    prefix = [shared, shared + 2, shared]  # request 1 also has 2 cached tokens of its own
    table[1, shared:shared + 2] = perm[shared:shared + 2]
    nxt, locs = shared + 2, []
    for i, e in enumerate(ext):
        table[i, prefix[i]:prefix[i] + e] = perm[nxt:nxt + e]
        locs.append(perm[nxt:nxt + e])
        nxt += e
    loc = torch.cat(locs)
    n = len(loc)
    q = torch.randn(n, H, D, generator=gen).to(dtype)
    backend = TorchNativeAttention(pool, H, HKV, D)
    fb = ForwardBatch.build(ForwardMode.EXTEND, [0] * n, loc, [0, 1, 2], prefix, ext, table)
    backend.init_forward_metadata(fb)
    assert getattr(fb.attn_metadata, "shared_index", None) is not None
    out = backend.forward(q, pool.k_buffer[0][loc].clone(), pool.v_buffer[0][loc].clone(), 0, fb, D ** -0.5)
    # Reference: token j of request i sees keys [0, prefix_i + j].
    rows, lens = [], []
    for i, e in enumerate(ext):
        for j in range(e):
            rows.append(table[i])
            lens.append(prefix[i] + j + 1)
    ref = _reference(q, pool.k_buffer[0], pool.v_buffer[0], torch.stack(rows), lens)
    assert (out.double() - ref).abs().max().item() < tol


def test_extend_with_long_suffixes_goes_per_request():
    """Tokens x keys past the shared prefix above max_extend_as_decode_suffix_keys (long
    prompts chunked over a common prefix) take the per-request SDPA path: the shared-prefix
    route would gather every token's suffix keys; below the bound it stays shared."""
    gen = torch.Generator().manual_seed(2)
    shared, cap = 80, 1200
    pool = MHATokenToKVPool(cap, 1, HKV, D, torch.float32, "cpu")
    pool.k_buffer[0][1:] = torch.randn(cap, HKV, D, generator=gen)
    pool.v_buffer[0][1:] = torch.randn(cap, HKV, D, generator=gen)
    table = torch.zeros(3, 512, dtype=torch.int64)
    perm = torch.randperm(cap, generator=gen) + 1
    table[:2, :shared] = perm[:shared]
    ext = [200, 150]
    table[0, shared:shared + 200] = perm[shared:shared + 200]
    table[1, shared:shared + 150] = perm[shared + 200:shared + 350]
    loc = torch.cat([table[0, shared:shared + 200], table[1, shared:shared + 150]])
    backend = TorchNativeAttention(pool, H, HKV, D)
    kinds = {}
    for bound in (350 * 200, 350 * 200 - 1):  # tokens x longest suffix = 350 x 200
        backend.max_extend_as_decode_suffix_keys = bound
        fb = ForwardBatch.build(ForwardMode.EXTEND, [0] * 350, loc, [0, 1], [shared, shared], ext, table)
        backend.init_forward_metadata(fb)
        kinds[bound] = getattr(fb.attn_metadata, "shared_index", None) is not None
        q = torch.randn(350, H, D, generator=gen)
        out = backend.forward(q, pool.k_buffer[0][loc].clone(), pool.v_buffer[0][loc].clone(), 0, fb, D ** -0.5)
        rows = [table[0]] * 200 + [table[1]] * 150
        lens = [shared + j + 1 for j in range(200)] + [shared + j + 1 for j in range(150)]
        ref = _reference(q, pool.k_buffer[0], pool.v_buffer[0], torch.stack(rows), lens)
        assert (out.double() - ref).abs().max().item() < 1e-4
    assert kinds == {350 * 200: True, 350 * 200 - 1: False}
