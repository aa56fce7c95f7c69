"""The AVX512-BF16 GEMM (kernels/cpu/bf16_gemm.cpp via layers/bf16_gemm.py): bfloat16 weights
and inputs, float32/bfloat16 outputs, against torch's linear in float64; and the property
speculative verification needs (a row's bits do not depend on the rows beside it). Skipped
where the build has no AVX512-BF16 (the AVX2 build on every machine; AVX2-only CPUs)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from radixlm.kernels.cpu import ops
from radixlm.kernels.cpu.cpuinfo import cpu_flags
from radixlm.srt.layers import bf16_gemm
from radixlm.srt.layers.linear import Linear


@pytest.fixture(autouse=True)
def _needs_bf16_gemm(bf16_kernel_isa: str) -> None:
    if not ops.bf16_gemm_available():
        pytest.skip(f"the {bf16_kernel_isa} build has no AVX512-BF16 GEMM")


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,k,n", [(1, 576, 960), (6, 64, 64), (7, 70, 100), (33, 1536, 576), (300, 64, 130),
                                   (2, 2, 17), (200, 40, 16), (97, 128, 192), (270, 650, 70)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_linear_matches_torch(out_dtype, m, k, n, with_bias):
    """Micro-tiles of 1-6 rows, row blocks of 96, partial last panels (n not a multiple of 64);
    on AMX also 16/32-row tiles, 256-row blocks, k chunks of 9 steps ending in a ragged one."""
    g = torch.Generator().manual_seed(m * 7 + k * 3 + n)
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(m, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16() if with_bias else None
    got = bf16_gemm.linear(x, bf16_gemm.pack_weight(w), bias, out_dtype)
    ref = F.linear(x.double(), w.double(), None if bias is None else bias.double())
    assert got is not None and got.shape == (m, n) and got.dtype == out_dtype
    rtol = 1e-5 if out_dtype == torch.float32 else 8e-3  # bf16: within one rounding of the float32 sum
    torch.testing.assert_close(got.double(), ref, atol=1e-4 * k ** 0.5, rtol=rtol)


@pytest.mark.parametrize("m,k,n,n_cols", [(1, 576, 1000, 1000), (32, 576, 4096, 4096), (33, 64, 700, 650),
                                          (5, 100, 70, 65), (3, 40, 31, 31), (200, 96, 2048, 2000)])
def test_argmax_is_the_bf16_outputs_argmax(m, k, n, n_cols):
    """Greedy sampling off a bf16 LM head: the GEMM keeps each row's best column of its bf16
    output (ties are common at bf16's precision: the first one) instead of writing it."""
    g = torch.Generator().manual_seed(m * n + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    x = (torch.randn(m, k, generator=g) * 2).bfloat16()
    packed = bf16_gemm.pack_weight(w)
    got = bf16_gemm.argmax(x, packed, n_cols)
    if ops.bf16_gemm_amx():  # the GEMMs run on tiles here: not offered, the caller computes the logits
        assert got is None
        return
    out = bf16_gemm.linear(x, packed, None)
    assert torch.equal(got, out.float()[:, :n_cols].argmax(-1))
    assert bf16_gemm.argmax(x, packed, n + 1) is None and bf16_gemm.argmax(x.float(), packed, n) is None


def test_argmax_takes_the_first_of_equal_columns_and_a_nan_first():
    if ops.bf16_gemm_amx():
        pytest.skip("not offered on AMX tiles")
    g = torch.Generator().manual_seed(3)
    n, k = 1024, 96
    w = (torch.randn(n, k, generator=g) * 0.01).bfloat16()
    for c in (37, 5, 600, 901, 21):
        w[c] = 0.5
    x = torch.ones(7, k).bfloat16()
    x[3] = -1.0
    packed = bf16_gemm.pack_weight(w)
    out = bf16_gemm.linear(x, packed, None).float()
    assert out.argmax(-1)[0].item() == 5
    assert torch.equal(bf16_gemm.argmax(x, packed, n), out.argmax(-1))
    x[2, 7] = float("nan")  # a NaN input: every output of the row is NaN, column 0 first
    assert bf16_gemm.argmax(x, packed, n)[2].item() == 0
    assert torch.equal(bf16_gemm.argmax(x, packed, n), bf16_gemm.linear(x, packed, None).float().argmax(-1))


@pytest.mark.parametrize("m,k,n", [(13, 96, 136), (70, 70, 200)])
def test_a_rows_result_does_not_depend_on_how_many_rows_come_with_it(m, k, n):
    """(70, 70): on AMX, rows in whole 16-row tiles read in place and rows of a partial tile
    copied with zeros, k not a multiple of the 32-k tile step."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(n, k, generator=g).bfloat16()
    packed = bf16_gemm.pack_weight(w)
    x = torch.randn(m, k, generator=g).bfloat16()
    full = bf16_gemm.linear(x, packed, None)
    spans = [(s, r) for s in range(m) for r in range(1, m + 1 - s)]
    for start, rows in spans if m <= 16 else spans[::37]:
        assert torch.equal(bf16_gemm.linear(x[start:start + rows].clone(), packed, None),
                           full[start:start + rows])
    assert torch.equal(bf16_gemm.linear(x[1:], packed, None), full[1:])  # whole tiles read in place


@pytest.mark.parametrize("m", [97, 100, 150, 193, 289, 1000])
def test_every_thread_count_writes_every_output_once_the_same(m: int):
    """Several 96-row blocks are claimed task by task by pairs of threads from both ends of
    their segment (gemm_tasks.h run_two_ended; an odd count's last thread alone): with 1-5
    threads (more than the cores is fine), every output of a NaN-filled buffer is written, and
    its bits are the one-thread result's."""
    k, n = 64, 200  # 4 panels, the last a partial one
    if ops.bf16_gemm_amx():
        pytest.skip("the AMX path has its own task split (bf16_gemm_amx.h)")
    g = torch.Generator().manual_seed(m)
    w = torch.randn(n, k, generator=g).bfloat16()
    packed = bf16_gemm.pack_weight(w).panels
    x = torch.randn(m, k, generator=g).bfloat16()
    lib = ops.load()

    def run(threads: int) -> torch.Tensor:
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
        assert lib.radixlm_bf16_linear(x.data_ptr(), k, m, k, packed.data_ptr(), n, None, 1, out.data_ptr(), n,
                                       threads) == 0
        return out

    one = run(1)
    assert not one.isnan().any()
    torch.testing.assert_close(one.float(), F.linear(x.float(), w.float()), atol=0.05, rtol=8e-3)
    for threads in (2, 3, 4, 5):
        got = run(threads)
        assert not got.isnan().any() and torch.equal(got, one), threads


def test_amx_serves_where_the_cpu_has_it_unless_turned_off(bf16_kernel_isa: str):
    """One path per process: the native build takes the tiles on an AMX CPU; RADIXLM_BF16_AMX=0
    (read once, at the first GEMM) keeps AVX512-BF16; the avx512 build never has them."""
    if bf16_kernel_isa != "native":
        assert not ops.bf16_gemm_amx()
        return
    has_amx = {"amx_bf16", "amx_tile"} <= cpu_flags()
    probe = "from radixlm.kernels.cpu import ops; print(ops.bf16_gemm_amx())"
    for env, want in (({}, has_amx), ({"RADIXLM_BF16_AMX": "0"}, False)):
        out = subprocess.run([sys.executable, "-c", probe], env={**os.environ, **env}, capture_output=True,
                             text=True, timeout=120, check=True).stdout.strip()
        assert out == str(want)


def test_refused_inputs_and_strided_rows():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(40, 24, generator=g).bfloat16()
    packed = bf16_gemm.pack_weight(w)
    assert packed.panels.shape == (1, 12, 64, 2)
    assert torch.equal(packed.panels[0, 5, 7], w[7, 10:12]) and (packed.panels[0, :, 40:] == 0).all()
    wide = torch.randn(9, 50, generator=g).bfloat16()
    x = wide[:, 10:34]  # rows 50 apart
    torch.testing.assert_close(bf16_gemm.linear(x, packed, None).float(), F.linear(x.float(), w.float()),
                               atol=0.05, rtol=8e-3)
    assert bf16_gemm.linear(torch.empty(0, 24, dtype=torch.bfloat16), packed, None).shape == (0, 40)
    assert bf16_gemm.linear(x.float(), packed, None) is None  # float32 input: the caller's torch path
    assert bf16_gemm.linear(x, packed, torch.zeros(40)) is None  # bias not in the weight's dtype: torch too
    assert not bf16_gemm.wanted(torch.bfloat16, "cpu", 25)  # odd in_features: oneDNN


def test_linear_module_takes_it_and_reverts_to_onednn_when_turned_off(monkeypatch: pytest.MonkeyPatch):
    lin = Linear(64, 80, bias=True, dtype=torch.bfloat16)
    lin.weight.data.normal_()
    lin.bias.data.normal_()
    x = torch.randn(5, 64).bfloat16()
    with torch.inference_mode():
        ours = lin(x)
        assert isinstance(lin._packed, bf16_gemm.PackedBf16Weight)
        monkeypatch.setenv("RADIXLM_BF16_GEMM", "0")
        lin.invalidate_packed()
        theirs = lin(x)
        assert not isinstance(lin._packed, bf16_gemm.PackedBf16Weight)
    torch.testing.assert_close(ours.float(), theirs.float(), atol=0.1, rtol=1e-2)


@pytest.mark.parametrize("m,k,inter", [(1, 576, 1536), (32, 576, 1536), (7, 70, 64), (300, 64, 32), (100, 96, 96)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_silu_gated_panels_are_the_unfused_pair_bit_for_bit(m, k, inter, with_bias):
    """A gate_up weight packed silu-gated (32 gate and 32 up rows per panel): linear_silu (SiLU *
    mul in the GEMM's epilogue) is silu_mul over the plain packing's output, gates below -88
    included; linear over the gated packing still returns [gate | up]."""
    g = torch.Generator().manual_seed(m * 5 + k + inter)
    w = torch.randn(2 * inter, k, generator=g) * 0.1
    w[:inter] *= 40
    w = w.bfloat16()
    x = torch.randn(m, k, generator=g).bfloat16()
    bias = (torch.randn(2 * inter, generator=g) * 3).bfloat16() if with_bias else None
    plain, gated = bf16_gemm.pack_weight(w), bf16_gemm.pack_weight(w, silu_gated=True)
    assert gated.silu_gated and not plain.silu_gated
    unfused = bf16_gemm.linear(x, plain, bias)
    assert unfused[:, :inter].float().min() < -100
    got = bf16_gemm.linear_silu(x, gated, bias)
    assert got is not None and got.shape == (m, inter)
    assert torch.equal(got, ops.silu_mul(unfused))
    assert torch.equal(bf16_gemm.linear(x, gated, bias), unfused)
    assert not bf16_gemm.pack_weight(w[:2 * inter - 32], silu_gated=True).silu_gated  # not whole panels


def test_gated_mlp_takes_the_fused_epilogue_in_bf16():
    from radixlm.srt.layers.activation import GatedMLP
    g = torch.Generator().manual_seed(9)
    mlp = GatedMLP(64, 96, dtype=torch.bfloat16)
    for lin in (mlp.gate_up_proj, mlp.down_proj):
        lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) * 0.2)
    x = torch.randn(5, 64, generator=g).bfloat16()
    got = mlp.forward(x)
    assert mlp.gate_up_proj.packed_weight().silu_gated
    plain = bf16_gemm.linear(x, bf16_gemm.pack_weight(mlp.gate_up_proj.weight), None)  # [gate | up]
    assert torch.equal(got, bf16_gemm.linear(ops.silu_mul(plain), mlp.down_proj.packed_weight(), None))
    assert torch.equal(mlp.gate_up_proj.forward(x), plain)
