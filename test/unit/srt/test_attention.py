"""Torch-native attention and the KV pool against a naive float64 reference."""
from __future__ import annotations

import pytest
import torch

from radixlm.kernels.cpu import ops as cpu_ops
from radixlm.srt.model_runner.attention.base import ATTENTION_BACKENDS, create_attention_backend
from radixlm.srt.model_runner.attention.torch_native import TorchNativeAttention
from radixlm.srt.model_runner.forward_batch import ForwardBatch, ForwardMode
from radixlm.srt.model_runner.kv_pool import MHATokenToKVPool

H, HKV, D, CAP, CTX = 8, 2, 16, 512, 256


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_pos: int) -> torch.Tensor:
    """q [L, H, D] at positions first_pos.., k/v [S, HKV, D] at positions 0..S-1."""
    g = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(g, dim=1), v.double().repeat_interleave(g, dim=1)
    out = torch.empty(q.shape, dtype=torch.float64)
    for i in range(q.shape[0]):
        s = first_pos + i + 1  # causal: sees keys 0..pos
        scores = torch.einsum("hd,shd->hs", q[i].double(), k[:s]) * D ** -0.5
        out[i] = torch.einsum("hs,shd->hd", scores.softmax(-1), v[:s])
    return out


class _World:
    """A KV pool whose per-request KV history is also kept in plain lists for reference."""

    def __init__(self, dtype=torch.float32, backend: str = "torch_native") -> None:
        self.pool = MHATokenToKVPool(CAP, 1, HKV, D, dtype, "cpu")
        # Never-written slots hold garbage: NaN must not leak through masked padding.
        self.pool.k_buffer[0][1:] = float("nan")
        self.pool.v_buffer[0][1:] = float("nan")
        self.req_to_token = torch.randint(0, CAP + 1, (8, CTX))  # garbage beyond each seq_len
        self.free = torch.randperm(CAP)[:CAP] + 1  # slots in scattered order
        self.used = 0
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.backend = create_attention_backend(backend, self.pool, H, HKV, D)
        self.gen = torch.Generator().manual_seed(0)

    def step(self, mode, rows: list[int], ext: list[int], dtype=torch.float32):
        prefix = [self.kv[r][0].shape[0] if r in self.kv else 0 for r in rows]
        n = sum(ext)
        loc = self.free[self.used:self.used + n]
        self.used += n
        q = torch.randn(n, H, D, generator=self.gen).to(dtype)
        k = torch.randn(n, HKV, D, generator=self.gen).to(dtype)
        v = torch.randn(n, HKV, D, generator=self.gen).to(dtype)
        start, refs = 0, []
        for r, p, e in zip(rows, prefix, ext):
            self.req_to_token[r, p:p + e] = loc[start:start + e]
            old_k, old_v = self.kv.get(r, (k[:0], v[:0]))
            self.kv[r] = (torch.cat([old_k, k[start:start + e]]), torch.cat([old_v, v[start:start + e]]))
            refs.append(naive_attention(q[start:start + e], *self.kv[r], p))
            start += e
        fb = ForwardBatch.build(mode, [0] * n, loc, rows, prefix, ext, self.req_to_token)
        self.backend.init_forward_metadata(fb)
        self.last_fb = fb
        out = self.backend.forward(q, k, v, 0, fb, D ** -0.5)
        return out, torch.cat(refs), loc, k


def test_registered():
    assert ATTENTION_BACKENDS.get("torch_native") is TorchNativeAttention


BACKENDS = ["torch_native", pytest.param("cpu", marks=pytest.mark.skipif(
    not cpu_ops.available(), reason="native CPU kernels could not be built"))]


@pytest.mark.parametrize("backend", BACKENDS)
def test_extend_with_and_without_prefix_then_decode(backend):
    w = _World(backend=backend)
    out, ref, loc, k = w.step(ForwardMode.EXTEND, [0, 1, 2], [7, 1, 20])
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(w.pool.k_buffer[0][loc], k)
    # Mixed: rows 0 and 2 have cached prefixes, row 3 is new.
    out, ref, _, _ = w.step(ForwardMode.EXTEND, [0, 3, 2], [5, 9, 1])
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    for _ in range(3):
        out, ref, _, _ = w.step(ForwardMode.DECODE, [2, 0, 1, 3], [1, 1, 1, 1])
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_single_request_and_long_ragged_batch(backend):
    w = _World(backend=backend)
    w.step(ForwardMode.EXTEND, [4], [150])
    out, ref, _, _ = w.step(ForwardMode.DECODE, [4], [1])
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    w.step(ForwardMode.EXTEND, [0, 1], [1, 60])
    out, ref, _, _ = w.step(ForwardMode.DECODE, [1, 4, 0], [1, 1, 1])
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bfloat16_pool(backend):
    w = _World(torch.bfloat16, backend)
    out, ref, _, _ = w.step(ForwardMode.EXTEND, [0, 1], [9, 4], dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref, atol=3e-2, rtol=3e-2)
    out, ref, _, _ = w.step(ForwardMode.DECODE, [0, 1], [1, 1], dtype=torch.bfloat16)
    torch.testing.assert_close(out.double(), ref, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_over_a_shared_radix_prefix(backend, dtype):
    """Requests whose first 100 slots are the same (a radix-shared prefix): torch_native's
    cascade (prefix by GEMM, suffixes separately, merged) and the cpu backend's kernel over
    every request's whole row (no cascade: slower there) equal plain attention."""
    w = _World(dtype, backend)
    w.step(ForwardMode.EXTEND, [0], [100], dtype=dtype)
    for r in (1, 2, 3):  # later requests reuse row 0's prefix slots, as a radix hit does
        w.req_to_token[r, :100] = w.req_to_token[0, :100]
        w.kv[r] = (w.kv[0][0].clone(), w.kv[0][1].clone())
    w.step(ForwardMode.EXTEND, [1, 2, 3], [1, 9, 30], dtype=dtype)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for _ in range(2):
        out, ref, _, _ = w.step(ForwardMode.DECODE, [3, 0, 2, 1], [1] * 4, dtype=dtype)
        shared_index = getattr(w.last_fb.attn_metadata, "shared_index", None)
        assert (shared_index is None) if backend == "cpu" else shared_index.numel() == 100
        torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


@pytest.mark.skipif(not cpu_ops.available(), reason="native CPU kernels could not be built")
def test_cpu_backend_float16_pool_decodes_through_torch():
    """A dtype the native kernel has no instance for falls back instead of failing."""
    w = _World(torch.float16, "cpu")
    w.step(ForwardMode.EXTEND, [0, 1], [9, 4], dtype=torch.float16)
    out, ref, _, _ = w.step(ForwardMode.DECODE, [0, 1], [1, 1], dtype=torch.float16)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.double(), ref, atol=3e-2, rtol=3e-2)


def test_kv_pool_layout_and_size():
    pool = MHATokenToKVPool(10, 3, 2, 4, torch.bfloat16, "cpu")
    assert len(pool.k_buffer) == 3 and pool.k_buffer[0].shape == (11, 2, 4)
    assert MHATokenToKVPool.bytes_per_token(3, 2, 4, torch.bfloat16) == 2 * 3 * 2 * 4 * 2
    assert pool.total_bytes() == 11 * 96
    loc = torch.tensor([3, 7])
    k, v = torch.ones(2, 2, 4), torch.full((2, 2, 4), 2.0)  # float32 in, stored as bf16
    pool.set_kv(1, loc, k, v)
    kb, vb = pool.get_kv(1)
    assert kb.dtype == torch.bfloat16 and torch.equal(kb[loc].float(), k) and torch.equal(vb[loc].float(), v)
    assert all(b[0].abs().sum() == 0 for b in (*pool.k_buffer, *pool.v_buffer))  # padding row
    with pytest.raises(ValueError):
        MHATokenToKVPool(0, 1, 1, 1, torch.float32)


@pytest.mark.parametrize("cost,cap,n_groups", [(0.0, 1, 8), (8.0, 64, 5), (1e9, 1 << 40, 1)],
                         ids=["loop", "groups", "single"])
def test_decode_grouping_plans_agree(cost, cap, n_groups):
    w = _World()
    w.backend.call_cost_keys, w.backend.max_group_keys = cost, cap
    rows = [0, 1, 2, 3, 4, 5, 6, 7]
    w.step(ForwardMode.EXTEND, rows, [3, 40, 7, 7, 90, 1, 25, 26])
    out, ref, _, _ = w.step(ForwardMode.DECODE, rows[::-1], [1] * 8)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    assert len(w.last_fb.attn_metadata.groups) == n_groups


def test_plan_decode_groups():
    from radixlm.srt.model_runner.attention.torch_native import plan_decode_groups

    lens = [5, 900, 7, 880, 6, 300, 910]
    groups = plan_decode_groups(lens, call_cost_keys=50.0)
    assert sorted(i for g in groups for i in g) == list(range(len(lens)))
    assert [sorted(lens[i] for i in g) for g in groups] == [[5, 6, 7], [300], [880, 900, 910]]
    assert plan_decode_groups([100] * 10, call_cost_keys=50.0) == [list(range(10))]
    capped = plan_decode_groups([100] * 10, call_cost_keys=50.0, max_group_keys=300)
    assert all(len(g) * 100 <= 300 for g in capped) and len(capped) == 4
    assert plan_decode_groups([3, 1], call_cost_keys=0.0) == [[1], [0]]
