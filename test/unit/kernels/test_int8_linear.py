"""W8A8 int8 linear (radixlm/srt/layers/int8_linear.py): the native per-row quantizer and
the prepacked GEMM (AVX512-VNNI, or the AVX2 sign trick: both builds where the CPU has
AVX-512, see conftest.kernel_isa) against their torch formulations, and the error against a
float linear."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from radixlm.kernels.cpu import ops
from radixlm.srt.layers import int8_linear as il

needs_kernels = pytest.mark.skipif(not ops.available(), reason="native CPU kernels could not be built")
needs_int8 = pytest.mark.skipif(not ops.int8_linear_available(),
                                reason="library built without the int8 GEMM (needs AVX2 or AVX512-VNNI)")
pytestmark = pytest.mark.usefixtures("kernel_isa")

# The integer dots are exact; the kernel sums the groups in float32 (the reference in
# float64), and the torch path multiplies dequantized floats: a few float32 roundings, or
# one bfloat16 ulp at a rounding boundary.
EPILOGUE_TOL = {torch.float32: {"atol": 1e-4, "rtol": 1e-5}, torch.bfloat16: {"atol": 1e-4, "rtol": 8e-3}}


def reference(x: torch.Tensor, w: il.Int8Weight, bias: torch.Tensor | None, out_dtype: torch.dtype):
    """Plain torch: group quantization, exact integer dot per group, float epilogue."""
    q, xs = il.quantize_activations(x)
    m, k = x.shape
    wq = torch.nn.functional.pad(w.qweight.long(), (0, q.shape[1] - k))
    dots = torch.einsum("mgk,ngk->mng", q.long().view(m, -1, il.GROUP), wq.view(wq.shape[0], -1, il.GROUP))
    out = (dots.double() * xs.double()[:, None, :]).sum(-1) * w.scale.double()
    if bias is not None:
        out = out + bias.double()
    return out.to(out_dtype)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,cols", [(1, 576), (5, 7), (33, 1536), (3, 1), (2, 70)])
def test_quantize_groups_matches_torch(dtype, rows, cols):
    g = torch.Generator().manual_seed(rows * cols)
    x = (torch.randn(rows, cols, generator=g) * 3).to(dtype)
    x[0] = 0  # an all-zero row: scale 0, q 0
    zero_group = rows > 1 and cols > il.GROUP
    if zero_group:
        x[1, :il.GROUP] = 0  # an all-zero group in a nonzero row
    q, scale = ops.quantize_groups(x)
    ref_q, ref_scale = il.quantize_activations(x)
    assert ops.int8_group_size() == il.GROUP
    assert torch.equal(q, (ref_q.to(torch.int16) + 128).to(torch.uint8))  # uint8 = int8 + 128, padding 128
    torch.testing.assert_close(scale, ref_scale, atol=0, rtol=0)
    groups = ref_q.view(rows, -1, il.GROUP).abs().amax(dim=2)
    assert torch.equal(groups == 127, scale > 0)  # every nonzero group uses the full range
    if zero_group:
        assert scale[1, 0] == 0 and scale[1, 1] > 0


@needs_int8
@pytest.mark.parametrize("in_dtype,out_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                                                (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("m,k,n", [(1, 576, 960), (6, 64, 64), (7, 70, 100), (13, 1536, 576), (32, 576, 3072),
                                   (300, 64, 130), (2, 3, 17)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_kernel_matches_reference(in_dtype, out_dtype, m, k, n, with_bias):
    """Every row count (micro-tiles of 1-6 rows, row chunks split across threads), K not a
    multiple of the group, N not a multiple of the 16/32-column blocks: torch's numbers."""
    g = torch.Generator().manual_seed(m * 7 + k * 3 + n)
    w = il.quantize_weight(torch.randn(n, k, generator=g), pack=False)
    packed = il.pack_int8_weight(w.qweight, w.scale)
    x = torch.randn(m, k, generator=g).to(in_dtype)
    bias = torch.randn(n, generator=g).to(out_dtype) if with_bias else None
    got = il.int8_linear(x, packed, bias, out_dtype)
    assert got.shape == (m, n) and got.dtype == out_dtype
    torch.testing.assert_close(got, reference(x, w, bias, out_dtype), **EPILOGUE_TOL[out_dtype])
    # the torch path (machines without the kernel) gives the same numbers
    torch.testing.assert_close(il.int8_linear(x, w, bias, out_dtype), got, **EPILOGUE_TOL[out_dtype])


@needs_int8
def test_packed_kernel_strided_and_batched_input():
    g = torch.Generator().manual_seed(3)
    w = il.quantize_weight(torch.randn(40, 24, generator=g), pack=False)
    packed = il.pack_int8_weight(w.qweight, w.scale)
    wide = torch.randn(9, 50, generator=g).to(torch.bfloat16)
    x = wide[:, 10:34]  # rows 50 apart
    torch.testing.assert_close(il.int8_linear(x, packed, None), reference(x, w, None, torch.bfloat16),
                               **EPILOGUE_TOL[torch.bfloat16])
    x3 = torch.randn(2, 3, 24, generator=g)
    out3 = il.int8_linear(x3, packed, None)
    assert out3.shape == (2, 3, 40)
    torch.testing.assert_close(out3.reshape(6, 40), reference(x3.reshape(6, 24), w, None, torch.float32),
                               **EPILOGUE_TOL[torch.float32])
    assert il.int8_linear(torch.empty(0, 24), packed, None).shape == (0, 40)


@needs_int8
def test_bound_gemm_matches_the_checked_call():
    """The decode fast path (Int8Weight.gemm, pointers bound once) gives bit-identical results
    to the generic checked call, and inputs it does not take (float16, a bias in another
    dtype) still go through the generic path."""
    g = torch.Generator().manual_seed(6)
    packed = il.quantize_weight(torch.randn(70, 64, generator=g))
    assert packed.gemm is not None and packed.packed is not None
    x = torch.randn(5, 64, generator=g).to(torch.bfloat16)
    bias = torch.randn(70, generator=g).to(torch.bfloat16)
    generic = ops.int8_linear(x, packed.packed, packed.comp, packed.scale, 70, bias, torch.bfloat16)
    assert torch.equal(packed.gemm(x, bias, torch.bfloat16), generic)
    assert torch.equal(il.int8_linear(x, packed, bias), generic)
    half = il.int8_linear(x.to(torch.float16), packed, bias.float(), torch.float16)
    assert half.dtype == torch.float16
    torch.testing.assert_close(half.float(), generic.float(), atol=2e-2, rtol=1e-2)


@needs_int8
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,k,n,n_cols", [(1, 576, 1000, 1000), (32, 576, 4096, 4096), (33, 64, 700, 650),
                                          (5, 100, 70, 65), (3, 40, 31, 31), (64, 96, 2048, 2000)])
def test_argmax_is_the_float32_outputs_argmax(dtype, m, k, n, n_cols):
    """Greedy sampling off an int8 LM head: the GEMM keeps each row's best column instead of
    writing the logits, and answers torch.argmax over the first n_cols float32 outputs."""
    g = torch.Generator().manual_seed(m * n + k)
    w = il.quantize_weight(torch.randn(n, k, generator=g) * 0.05)
    x = (torch.randn(m, k, generator=g) * 2).to(dtype)
    want = il.int8_linear(x, w, None, torch.float32)[:, :n_cols].argmax(-1)
    assert torch.equal(w.gemm.argmax(x, n_cols), want)
    assert w.gemm.argmax(x, n + 1) is None and w.gemm.argmax(x, 0) is None  # not a column range of it


@needs_int8
def test_argmax_takes_the_first_of_equal_columns_and_a_nan_first():
    # Equal rows of the weight give bit-equal outputs: the first such column is the answer,
    # wherever the others fall (another tile, the other thread's tiles, another lane).
    g = torch.Generator().manual_seed(3)
    n, k = 1024, 96
    weight = torch.randn(n, k, generator=g) * 0.01
    for c in (37, 5, 600, 901, 21):
        weight[c] = 0.5
    x = torch.ones(7, k)
    x[3] = -1.0  # this row's largest are elsewhere: the most negative weight sums
    w = il.quantize_weight(weight)
    out = il.int8_linear(x, w, None, torch.float32)
    want = out.argmax(-1)
    assert want[0].item() == 5 and want[3].item() != 5
    assert torch.equal(w.gemm.argmax(x, n), want)
    # NaN outputs (here a NaN channel scale): torch.argmax answers the first NaN column.
    w.scale[700] = float("nan")
    w.scale[44] = float("nan")
    want = il.int8_linear(x, w, None, torch.float32).argmax(-1)
    assert want.tolist() == [44] * 7
    assert torch.equal(w.gemm.argmax(x, n), want)
    assert torch.equal(w.gemm.argmax(x, 40), out[:, :40].argmax(-1))  # the NaN columns are past n_cols


def test_argmax_is_not_offered_for_a_silu_gated_weight():
    if not ops.int8_linear_available():
        pytest.skip("library built without the int8 GEMM")
    g = torch.Generator().manual_seed(4)
    w = il.quantize_weight(torch.randn(64, 32, generator=g), silu_gated=True)
    assert w.gemm is not None and w.gemm.argmax(torch.randn(2, 32), 32) is None


@needs_int8
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,k,inter", [(1, 576, 1536), (32, 576, 1536), (7, 70, 48), (300, 64, 16), (13, 100, 32)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_silu_gated_gemm_is_the_unfused_pair_bit_for_bit(dtype, m, k, inter, with_bias):
    """A gate_up weight packed silu-gated: int8_linear_silu (SiLU * mul in the GEMM's epilogue)
    gives exactly silu_mul over the plain weight's output, gates far below -88 included; the
    plain call on the gated packing still returns [gate | up]."""
    g = torch.Generator().manual_seed(m * 5 + k + inter)
    w = torch.randn(2 * inter, k, generator=g) * 0.1
    w[:inter] *= 40  # gates of either sign far out, where e^-g overflows
    x = torch.randn(m, k, generator=g).to(dtype)
    bias = (torch.randn(2 * inter, generator=g) * 3).to(dtype) if with_bias else None
    plain, gated = il.quantize_weight(w), il.quantize_weight(w, silu_gated=True)
    assert gated.silu_gated and not plain.silu_gated
    unfused = il.int8_linear(x, plain, bias)
    assert unfused[:, :inter].float().min() < -100  # the overflow case is exercised
    want = ops.silu_mul(unfused)
    got = il.int8_linear_silu(x, gated, bias)
    assert got.shape == (m, inter) and got.dtype == dtype
    assert torch.equal(got, want)
    generic = ops.int8_linear(x, gated.packed, gated.comp, gated.scale, 2 * inter,
                              il.silu_gated_order(bias, il.TILE_COLS) if bias is not None else None, dtype, silu=True)
    assert torch.equal(generic, want)  # the checked call, as the bound one
    assert torch.equal(il.int8_linear(x, gated, bias), unfused)
    x3 = x.reshape(1, m, k)
    assert torch.equal(il.int8_linear_silu(x3, gated, bias), want.reshape(1, m, inter))


@needs_int8
def test_gated_mlp_takes_the_fused_epilogue():
    """GatedMLP in w8a8 packs its gate_up silu-gated and gives the unfused pipeline's bits."""
    from radixlm.srt.layers.activation import GatedMLP
    g = torch.Generator().manual_seed(8)
    mlp = GatedMLP(64, 48, dtype=torch.bfloat16)
    for lin in (mlp.gate_up_proj, mlp.down_proj):
        lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) * 0.2)
        lin.quantization = "w8a8_int8"
    x = torch.randn(5, 64, generator=g).to(torch.bfloat16)
    got = mlp.forward(x)
    assert mlp.gate_up_proj.int8_weight().silu_gated
    act = ops.silu_mul(il.int8_linear(x, il.quantize_weight(mlp.gate_up_proj.weight), None))
    assert torch.equal(got, il.int8_linear(act, mlp.down_proj.int8_weight(), None))


@needs_int8
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 5, 32])
@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize("with_residual", [False, True])
def test_norm_prologue_is_add_rmsnorm_then_the_gemm_bit_for_bit(dtype, m, silu, with_residual):
    """int8_linear_norm (the decoder layers' norm done by the GEMM's threads, row by row):
    the normed rows, the updated residual and the output are those of add_rmsnorm followed by
    the GEMM (or the silu-gated one)."""
    from radixlm.kernels.cpu import build
    g = torch.Generator().manual_seed(m * 3 + silu)
    k, n = 96, 64
    w = il.quantize_weight(torch.randn(n, k, generator=g) * 0.2, silu_gated=silu)
    assert w.silu_gated == silu
    norm_w = (torch.rand(k, generator=g) + 0.5).to(dtype)
    wide = (torch.randn(m, k + 8, generator=g) * 2).to(dtype)
    h = wide[:, 4:4 + k]  # rows k + 8 apart
    residual = (torch.randn(m, k, generator=g) * 3).to(dtype) if with_residual else None
    ref_res = residual.clone() if with_residual else None
    ref_normed = ops.add_rmsnorm(h, ref_res, norm_w, 1e-5)
    ref = il.int8_linear_silu(ref_normed, w, None) if silu else il.int8_linear(ref_normed, w, None)
    normed = torch.empty(m, k, dtype=dtype)
    out = torch.empty(m, n // 2 if silu else n, dtype=dtype)
    code = ops._DTYPE_CODE[dtype]
    rc = build.load().radixlm_int8_linear_norm(
        code, h.data_ptr(), h.stride(0), residual.data_ptr() if with_residual else None, norm_w.data_ptr(), 1e-5,
        normed.data_ptr(), m, k, w.packed.data_ptr(), w.comp.data_ptr(), w.scale.data_ptr(), n, code, None,
        out.data_ptr(), out.shape[1], int(silu), 2)
    assert rc == 0
    assert torch.equal(normed, ref_normed) and torch.equal(out, ref)
    if with_residual:
        assert torch.equal(residual, ref_res)


def test_silu_gated_packing_needs_whole_tiles():
    """An MLP width that is not a multiple of 16 keeps the plain packing (and the unfused
    pair); the row order round-trips."""
    w = torch.randn(2 * 24, 32)
    assert not il.quantize_weight(w, pack=False, silu_gated=True).silu_gated
    if ops.int8_linear_available():
        assert not il.quantize_weight(w, silu_gated=True).silu_gated
    t = torch.arange(64)
    order = il.silu_gated_order(t, il.TILE_COLS)
    assert order[:16].tolist() == list(range(16)) and order[16:32].tolist() == list(range(32, 48))
    assert torch.equal(il.gate_up_order(order, il.TILE_COLS), t)


def test_quantized_linear_error_is_small():
    """Per-channel weights and per-group activations keep a Gaussian layer within ~1.5%."""
    g = torch.Generator().manual_seed(4)
    w = torch.randn(256, 512, generator=g)
    x = torch.randn(16, 512, generator=g)
    for pack in (False, True) if ops.int8_linear_available() else (False,):
        out = il.int8_linear(x, il.quantize_weight(w, pack=pack), None)
        ref = F.linear(x, w)
        assert ((out - ref).norm() / ref.norm()).item() < 0.015


def test_torch_fallbacks_match_native_formulas(monkeypatch):
    """With the library unavailable the torch path computes the same quantities."""
    from radixlm.kernels.cpu import build as cpu_build
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 33, generator=g).to(torch.bfloat16)
    w = il.quantize_weight(torch.randn(20, 33, generator=g), pack=False)
    native = il.int8_linear(x, w, None)
    monkeypatch.setattr(cpu_build, "_lib", None)
    monkeypatch.setattr(cpu_build, "_tried", True)
    assert il.quantize_weight(torch.randn(3, 4)).packed is None  # no library: never packed
    torch.testing.assert_close(il.int8_linear(x, w, None), native, **EPILOGUE_TOL[torch.bfloat16])
    torch.testing.assert_close(native, reference(x, w, None, torch.bfloat16), **EPILOGUE_TOL[torch.bfloat16])


def test_check_quantization():
    il.check_quantization(None, "cuda")
    il.check_quantization("w8a8_int8", "cpu")
    with pytest.raises(ValueError, match="CPU only"):
        il.check_quantization("w8a8_int8", "cuda")
    with pytest.raises(ValueError, match="unknown quantization"):
        il.check_quantization("fp8", "cpu")
