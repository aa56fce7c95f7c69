"""The AVX2 float GEMM (kernels/cpu/float_gemm.cpp via layers/float_gemm.py): float32 and
bfloat16 weights, inputs and outputs against torch's float32 linear (on every ISA build, see
conftest.kernel_isa)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from radixlm.kernels.cpu import ops
from radixlm.srt.layers import float_gemm

pytestmark = [pytest.mark.skipif(not ops.float_gemm_available(), reason="library built without AVX2 + FMA"),
              pytest.mark.usefixtures("kernel_isa")]


@pytest.mark.parametrize("w_dtype,x_dtype,out_dtype", [(torch.float32, torch.float32, torch.float32),
                                                       (torch.bfloat16, torch.bfloat16, torch.bfloat16),
                                                       (torch.bfloat16, torch.bfloat16, torch.float32),
                                                       (torch.float32, torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("m,k,n", [(1, 576, 960), (6, 64, 64), (7, 70, 100), (33, 1536, 576), (300, 64, 130),
                                   (2, 3, 17), (200, 40, 16)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_float_linear_matches_torch(w_dtype, x_dtype, out_dtype, m, k, n, with_bias):
    """Micro-tiles of 1-6 rows, row blocks of 192, partial last panels; float32 sums (the
    reference in float64), one rounding to the output dtype."""
    g = torch.Generator().manual_seed(m * 7 + k * 3 + n)
    w = torch.randn(n, k, generator=g).to(w_dtype)
    x = torch.randn(m, k, generator=g).to(x_dtype)
    bias = torch.randn(n, generator=g).to(out_dtype) if with_bias else None
    got = float_gemm.linear(x, float_gemm.pack_weight(w), bias, out_dtype)
    ref = F.linear(x.double(), w.double(), None if bias is None else bias.double())
    assert got is not None and got.shape == (m, n) and got.dtype == out_dtype
    if out_dtype == torch.float32:
        torch.testing.assert_close(got.double(), ref, atol=1e-4 * k ** 0.5, rtol=1e-5)
    else:  # within one bf16 rounding of the float32 result
        torch.testing.assert_close(got.double(), ref, atol=1e-4 * k ** 0.5, rtol=8e-3)


def test_float_linear_batched_strided_and_refused_inputs():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(40, 24, generator=g)
    packed = float_gemm.pack_weight(w)
    wide = torch.randn(9, 50, generator=g)
    x = wide[:, 10:34]  # rows 50 apart
    torch.testing.assert_close(float_gemm.linear(x, packed, None), F.linear(x, w), atol=1e-5, rtol=1e-5)
    x3 = torch.randn(2, 3, 24, generator=g)
    torch.testing.assert_close(float_gemm.linear(x3, packed, None), F.linear(x3, w), atol=1e-5, rtol=1e-5)
    assert float_gemm.linear(torch.empty(0, 24), packed, None).shape == (0, 40)
    assert float_gemm.linear(x.half(), packed, None) is None  # float16: the caller's torch path
    assert float_gemm.linear(x, packed, torch.zeros(40, dtype=torch.bfloat16)) is None  # bias dtype != out


def test_pack_weight_layout():
    w = torch.arange(20 * 3, dtype=torch.float32).view(20, 3)
    p = float_gemm.pack_weight(w).panels
    assert p.shape == (2, 3, 16)
    assert torch.equal(p[0, 1, 5], w[5, 1]) and torch.equal(p[1, 2, 3], w[19, 2])
    assert (p[1, :, 4:] == 0).all()  # padding columns


@pytest.mark.parametrize("m", [193, 200, 385, 1000])
def test_every_thread_count_writes_every_output_once_the_same(m: int):
    """Several 192-row blocks (two claims of 16 micro-tiles a task) are claimed by pairs of
    threads from both ends of their segment (gemm_tasks.h run_two_ended): with 1-5 threads
    every output of a NaN-filled buffer is written, and its bits are the one-thread result's."""
    k, n = 40, 72  # 5 panels of 16, the last a partial one
    g = torch.Generator().manual_seed(m)
    w = torch.randn(n, k, generator=g)
    panels = float_gemm.pack_weight(w).panels
    x = torch.randn(m, k, generator=g)
    lib = ops.load()

    def run(threads: int) -> torch.Tensor:
        out = torch.full((m, n), float("nan"))
        assert lib.radixlm_float_linear(0, x.data_ptr(), k, m, k, 0, panels.data_ptr(), n, 0, None, out.data_ptr(),
                                        n, threads) == 0
        return out

    one = run(1)
    torch.testing.assert_close(one, F.linear(x, w), atol=1e-4, rtol=1e-5)
    for threads in (2, 3, 4, 5):
        got = run(threads)
        assert not got.isnan().any() and torch.equal(got, one), threads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_result_does_not_depend_on_how_many_rows_come_with_it(dtype: torch.dtype):
    # What speculative verification needs: an extend of K rows gives K decode rows bit for bit.
    g = torch.Generator().manual_seed(5)
    w = torch.randn(72, 96, generator=g).to(dtype)
    packed = float_gemm.pack_weight(w)
    x = torch.randn(13, 96, generator=g).to(dtype)
    full = float_gemm.linear(x, packed, None)
    for start in range(13):
        for rows in range(1, 14 - start):
            assert torch.equal(float_gemm.linear(x[start:start + rows].clone(), packed, None),
                               full[start:start + rows])


def test_float32_always_takes_the_native_kernel(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("RADIXLM_FLOAT_GEMM", raising=False)
    assert float_gemm.wanted(torch.float32, "cpu")
    assert not float_gemm.wanted(torch.float16, "cpu")
    monkeypatch.setenv("RADIXLM_FLOAT_GEMM", "0")
    assert not float_gemm.wanted(torch.float32, "cpu")
    monkeypatch.setenv("RADIXLM_FLOAT_GEMM", "1")
    assert float_gemm.wanted(torch.bfloat16, "cpu")
