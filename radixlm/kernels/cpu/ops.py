"""torch-facing wrappers of the native CPU kernels (cpu_ops.cpp), with the checks the
C side does not do: dtype, device, contiguity of the innermost dimension.

Every function returns None (or False) when the native library is unavailable or the
inputs are outside what it handles; callers then run their torch implementation, which is
also the reference the tests compare against.
"""
from __future__ import annotations

import ctypes

import torch

from radixlm.kernels.cpu.build import load

_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1}


def available() -> bool:
    return load() is not None


def supports(t: torch.Tensor) -> bool:
    """Whether tensors like `t` (dtype/device) can use the native kernels."""
    return t.device.type == "cpu" and t.dtype in _DTYPE_CODE and available()


DECODE_HEAD_DIMS = (16, 32, 64, 80, 96, 128, 256)  # the head dims cpu_ops.cpp instantiates
MAX_GROUP = 16  # query heads per KV head


def decode_supported(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    return (available() and num_kv_heads > 0 and num_heads % num_kv_heads == 0
            and num_heads // num_kv_heads <= MAX_GROUP and head_dim in DECODE_HEAD_DIMS)


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def _rows_ok(t: torch.Tensor) -> bool:
    """2-D view [n, row] whose rows are contiguous (any row stride)."""
    return t.dim() == 2 and t.stride(1) == 1


def decode_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, kv_indptr: torch.Tensor,
                     kv_indices: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                     lse: torch.Tensor | None = None) -> torch.Tensor | None:
    """Single-query attention per request b over keys kv_indices[kv_indptr[b]:kv_indptr[b+1]].

    q: [B, Hq, D] with each token's heads contiguous; k_buf/v_buf: [slots, Hkv, D] contiguous;
    kv_indptr [B+1], kv_indices int64. Returns out [B, Hq, D] (q's dtype); fills lse [B, Hq]
    float32 (log-sum-exp of the scaled scores) when given. None when unsupported.
    """
    lib = load()
    b, hq, d = q.shape
    hkv = k_buf.shape[1]
    if lib is None or q.dtype not in _DTYPE_CODE or k_buf.dtype != q.dtype or v_buf.dtype != q.dtype:
        return None
    if q.stride(2) != 1 or q.stride(1) != d or not (k_buf.is_contiguous() and v_buf.is_contiguous()):
        return None
    if kv_indptr.dtype != torch.int64 or kv_indices.dtype != torch.int64 or not kv_indices.is_contiguous():
        return None
    if out is None:
        out = torch.empty((b, hq, d), dtype=q.dtype)
    if lse is not None and (lse.dtype != torch.float32 or not lse.is_contiguous()):
        return None
    rc = lib.radixlm_decode_attention(_DTYPE_CODE[q.dtype], _ptr(q), q.stride(0), _ptr(k_buf), _ptr(v_buf),
                                      _ptr(kv_indptr), _ptr(kv_indices), _ptr(out), out.stride(0),
                                      _ptr(lse) if lse is not None else None, b, hq, hkv, d, scale,
                                      torch.get_num_threads())
    return out if rc == 0 else None


EXTEND_HEAD_DIMS = (32, 64, 96, 128, 256)  # the head dims extend_attention.cpp instantiates
EXTEND_PACK_BUDGET = 64 << 20  # bytes of packed K/V per group of requests (the kernel's workspace)


def extend_attention_supported(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether the native bf16 prefill attention (extend_attention.cpp, AVX512-BF16 only) runs
    these shapes."""
    lib = load()
    return (lib is not None and lib.radixlm_extend_attention_available() == 1 and num_kv_heads > 0
            and num_heads % num_kv_heads == 0 and head_dim in EXTEND_HEAD_DIMS)


def extend_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, q_indptr: torch.Tensor,
                     kv_indptr: torch.Tensor, kv_indices: torch.Tensor, scale: float,
                     pack_budget_bytes: int = EXTEND_PACK_BUDGET, k_scale: torch.Tensor | None = None,
                     v_scale: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor | None:
    """Causal attention of each request's new tokens over its cached prefix and themselves.

    Request b: query rows q[q_indptr[b]:q_indptr[b+1]] (its new tokens in order), keys
    kv_indices[kv_indptr[b]:kv_indptr[b+1]] (pool slots, prefix then the new tokens, whose K/V
    are already stored), so new token i sees the first len - ext + i + 1 keys. q: bfloat16
    [T, Hq, D] with each token's heads contiguous; k_buf/v_buf bfloat16 [slots, Hkv, D]
    contiguous, or int8 with k_scale/v_scale float32 [slots, Hkv] contiguous (the int8 KV
    cache: dequantized to bf16 as kv_pool.dequantize_kv does); indptrs and indices int64.
    Requests are done in groups whose packed K/V fit pack_budget_bytes. With `window` (a
    sliding-window layer) the new token at key position p sees only keys p - window < j <= p.
    Returns out [T, Hq, D], None when unsupported.
    """
    lib = load()
    t, hq, d = q.shape
    if lib is None or q.dtype != torch.bfloat16:
        return None
    if k_scale is None and v_scale is None:
        if k_buf.dtype != q.dtype or v_buf.dtype != q.dtype:
            return None
    elif k_scale is None or v_scale is None or k_buf.dtype != torch.int8 or v_buf.dtype != torch.int8:
        return None
    else:
        for sc in (k_scale, v_scale):
            if sc.dtype != torch.float32 or not sc.is_contiguous() or sc.shape != k_buf.shape[:2]:
                return None
    if q.stride(2) != 1 or q.stride(1) != d or not (k_buf.is_contiguous() and v_buf.is_contiguous()):
        return None
    for ix in (q_indptr, kv_indptr, kv_indices):
        if ix.dtype != torch.int64 or not ix.is_contiguous():
            return None
    b = q_indptr.numel() - 1
    if kv_indptr.numel() != b + 1 or int(q_indptr[-1]) != t:
        return None
    if window is not None and window < 1:
        return None
    out = torch.empty((t, hq, d), dtype=q.dtype)
    rc = lib.radixlm_extend_attention_window_bf16(_ptr(q), q.stride(0), _ptr(k_buf), _ptr(v_buf),
                                                  _ptr(k_scale) if k_scale is not None else None,
                                                  _ptr(v_scale) if v_scale is not None else None, _ptr(q_indptr),
                                                  _ptr(kv_indptr), _ptr(kv_indices), _ptr(out), out.stride(0), b, hq,
                                                  k_buf.shape[1], d, scale, pack_budget_bytes, window or 0,
                                                  torch.get_num_threads())
    return out if rc == 0 else None


def rope_inplace(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Rotate (neox style) every head of x [T, H, D] in place; cos/sin float32 [max_pos, D/2]
    contiguous. False when unsupported (x untouched)."""
    lib = load()
    if lib is None or x.dtype not in _DTYPE_CODE or x.stride(2) != 1 or x.stride(1) != x.shape[2]:
        return False
    if cos.dtype != torch.float32 or not (cos.is_contiguous() and sin.is_contiguous()):
        return False
    if positions.dtype != torch.int64 or not positions.is_contiguous():
        return False
    t, h, d = x.shape
    rc = lib.radixlm_rope_inplace(_DTYPE_CODE[x.dtype], _ptr(x), t, x.stride(0), h, d, _ptr(positions),
                                  _ptr(cos), _ptr(sin), torch.get_num_threads())
    return rc == 0


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                eps: float) -> torch.Tensor | None:
    """rmsnorm(x + residual) * weight; residual (contiguous [T, H]) is updated in place to
    x + residual. Without residual: rmsnorm(x) * weight. None when unsupported."""
    lib = load()
    if lib is None or x.dtype not in _DTYPE_CODE or weight.dtype != x.dtype or not _rows_ok(x):
        return None
    if residual is not None and (residual.dtype != x.dtype or not residual.is_contiguous()):
        return None
    n, h = x.shape
    out = torch.empty((n, h), dtype=x.dtype)
    rc = lib.radixlm_add_rmsnorm(_DTYPE_CODE[x.dtype], _ptr(x), x.stride(0),
                                 _ptr(residual) if residual is not None else None, _ptr(weight.contiguous()),
                                 _ptr(out), n, h, eps, torch.get_num_threads())
    return out if rc == 0 else None


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """[n, 2I] contiguous (gate then up) -> silu(gate) * up [n, I]. None when unsupported."""
    lib = load()
    if lib is None or gate_up.dtype not in _DTYPE_CODE or gate_up.dim() != 2 or not gate_up.is_contiguous():
        return None
    n, i2 = gate_up.shape
    out = torch.empty((n, i2 // 2), dtype=gate_up.dtype)
    lib.radixlm_silu_mul(_DTYPE_CODE[gate_up.dtype], _ptr(gate_up), _ptr(out), n, i2 // 2,
                         torch.get_num_threads())
    return out


def store_kv(k: torch.Tensor, v: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
             loc: torch.Tensor) -> bool:
    """k_buf[loc] = k; v_buf[loc] = v for k, v [n, Hkv, D] (heads contiguous per token)."""
    lib = load()
    if lib is None or k.dtype not in _DTYPE_CODE or not (k.dtype == v.dtype == k_buf.dtype == v_buf.dtype):
        return False
    row = k_buf.shape[1] * k_buf.shape[2]
    for t in (k, v):
        if t.stride(2) != 1 or t.stride(1) != t.shape[2]:
            return False
    if not (k_buf.is_contiguous() and v_buf.is_contiguous()) or loc.dtype != torch.int64 \
            or not loc.is_contiguous():
        return False
    lib.radixlm_store_kv(_DTYPE_CODE[k.dtype], _ptr(k), k.stride(0), _ptr(v), v.stride(0), _ptr(k_buf),
                         _ptr(v_buf), _ptr(loc), loc.numel(), row)
    return True


def store_kv_int8(k: torch.Tensor, v: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                  k_scale: torch.Tensor, v_scale: torch.Tensor, loc: torch.Tensor) -> bool:
    """Quantize k, v [n, Hkv, D] (heads contiguous per token) into an int8 pool: k_buf[loc] and
    k_scale[loc] as kv_pool.quantize_kv gives them, same for v. False when unsupported."""
    lib = load()
    if lib is None or k.dtype not in _DTYPE_CODE or v.dtype != k.dtype:
        return False
    if k_buf.dtype != torch.int8 or v_buf.dtype != torch.int8 or k_scale.dtype != torch.float32 \
            or v_scale.dtype != torch.float32:
        return False
    for t in (k, v):
        if t.stride(2) != 1 or t.stride(1) != t.shape[2]:
            return False
    if not all(t.is_contiguous() for t in (k_buf, v_buf, k_scale, v_scale, loc)) or loc.dtype != torch.int64:
        return False
    n, hkv, d = k.shape
    lib.radixlm_store_kv_int8(_DTYPE_CODE[k.dtype], _ptr(k), k.stride(0), _ptr(v), v.stride(0), _ptr(k_buf),
                              _ptr(v_buf), _ptr(k_scale), _ptr(v_scale), _ptr(loc), n, hkv, d,
                              torch.get_num_threads())
    return True


def gather_dequant_int8(q_buf: torch.Tensor, scale: torch.Tensor, index: torch.Tensor,
                        dtype: torch.dtype) -> torch.Tensor | None:
    """q_buf[index] * scale[index] per (row, head) as [n, Hkv, D] in dtype (float32/bfloat16),
    equal to kv_pool.dequantize_kv of the gathered rows. None when unsupported."""
    lib = load()
    if lib is None or dtype not in _DTYPE_CODE or q_buf.dtype != torch.int8 or scale.dtype != torch.float32:
        return None
    if q_buf.device.type != "cpu" or index.dtype != torch.int64 or not all(
            t.is_contiguous() for t in (q_buf, scale, index)):
        return None
    n, (hkv, d) = index.numel(), q_buf.shape[1:]
    out = torch.empty((n, hkv, d), dtype=dtype)
    lib.radixlm_gather_dequant_int8(_DTYPE_CODE[dtype], _ptr(q_buf), _ptr(scale), _ptr(index), n, hkv, d,
                                    _ptr(out), torch.get_num_threads())
    return out


def decode_int8_supported(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether decode_attention_int8 handles these shapes on this build (AVX512-VNNI or AVX2)."""
    lib = load()
    return (lib is not None and num_kv_heads > 0 and num_heads % num_kv_heads == 0
            and num_heads // num_kv_heads <= MAX_GROUP and lib.radixlm_decode_int8_supports(head_dim) == 1)


def decode_attention_int8(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, k_scale: torch.Tensor,
                          v_scale: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, scale: float,
                          lse: torch.Tensor | None = None) -> torch.Tensor | None:
    """decode_attention over an int8 pool: k_buf/v_buf int8 [slots, Hkv, D] with float32
    k_scale/v_scale [slots, Hkv] (value ~= int8 * scale). Same contract otherwise; the query
    is quantized per head to int8 inside (kv_int8_ops.cpp). None when unsupported."""
    lib = load()
    b, hq, d = q.shape
    hkv = k_buf.shape[1]
    if lib is None or q.dtype not in _DTYPE_CODE or k_buf.dtype != torch.int8 or v_buf.dtype != torch.int8:
        return None
    if q.stride(2) != 1 or q.stride(1) != d:
        return None
    if not all(t.is_contiguous() for t in (k_buf, v_buf, k_scale, v_scale, kv_indices)):
        return None
    if kv_indptr.dtype != torch.int64 or kv_indices.dtype != torch.int64:
        return None
    if lse is not None and (lse.dtype != torch.float32 or not lse.is_contiguous()):
        return None
    out = torch.empty((b, hq, d), dtype=q.dtype)
    rc = lib.radixlm_decode_attention_int8(_DTYPE_CODE[q.dtype], _ptr(q), q.stride(0), _ptr(k_buf), _ptr(v_buf),
                                           _ptr(k_scale), _ptr(v_scale), _ptr(kv_indptr), _ptr(kv_indices),
                                           _ptr(out), out.stride(0), _ptr(lse) if lse is not None else None,
                                           b, hq, hkv, d, scale, torch.get_num_threads())
    return out if rc == 0 else None


def int8_group_size() -> int:
    """Input features per activation scale of the int8 kernels (quant_ops.cpp kGroup)."""
    lib = load()
    return lib.radixlm_int8_group_size() if lib is not None else 0


def quantize_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """x [M, K] (rows contiguous) -> (q uint8 [M, Kp] = int8 value + 128, zero-padded to Kp =
    whole groups; scale float32 [M, Kp / group]), one symmetric scale per group of
    int8_group_size() features. None when unsupported."""
    lib = load()
    if lib is None or x.dtype not in _DTYPE_CODE or not _rows_ok(x):
        return None
    m, k = x.shape
    group = lib.radixlm_int8_group_size()
    ng = -(-k // group)
    q = torch.empty((m, ng * group), dtype=torch.uint8)
    scale = torch.empty((m, ng), dtype=torch.float32)
    rc = lib.radixlm_quantize_groups(_DTYPE_CODE[x.dtype], _ptr(x), x.stride(0), m, k, ng, _ptr(q), _ptr(scale),
                                     torch.get_num_threads())
    return (q, scale) if rc == 0 else None


def int8_linear_available() -> bool:
    """Whether the library has the prepacked int8 GEMM (AVX512-VNNI or AVX2 builds)."""
    lib = load()
    return lib is not None and lib.radixlm_int8_linear_available() == 1


def int8_linear(x: torch.Tensor, packed: torch.Tensor, comp: torch.Tensor, w_scale: torch.Tensor, n: int,
                bias: torch.Tensor | None, out_dtype: torch.dtype, silu: bool = False) -> torch.Tensor | None:
    """x [M, K] (rows contiguous) times a weight packed by int8_linear.pack_int8_weight (n
    output columns) -> [M, n] in out_dtype, activations quantized per group inside. bias,
    if given, is out_dtype. silu: a gate_up weight in the silu-gated tile order (n = 2I,
    whole tiles) -> silu(gate) * up [M, n / 2] (quant_ops.cpp int8_linear_silu). None when
    unsupported."""
    lib = load()
    if lib is None or x.dtype not in _DTYPE_CODE or out_dtype not in _DTYPE_CODE or not _rows_ok(x):
        return None
    if bias is not None and (bias.dtype != out_dtype or not bias.is_contiguous()):
        return None
    m, k = x.shape
    n_out = n // 2 if silu else n
    out = torch.empty((m, n_out), dtype=out_dtype)
    fn = lib.radixlm_int8_linear_silu if silu else lib.radixlm_int8_linear
    rc = fn(_DTYPE_CODE[x.dtype], _ptr(x), x.stride(0), m, k, _ptr(packed), _ptr(comp), _ptr(w_scale), n,
            _DTYPE_CODE[out_dtype], _ptr(bias) if bias is not None else None, _ptr(out), n_out,
            torch.get_num_threads())
    return out if rc == 0 else None


def float_gemm_available() -> bool:
    """Whether the library has the AVX2 + FMA float GEMM (float_gemm.cpp)."""
    lib = load()
    return lib is not None and lib.radixlm_float_gemm_available() == 1


def float_linear(x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None,
                 out_dtype: torch.dtype) -> torch.Tensor | None:
    """x [M, K] (rows contiguous) times a weight packed by float_gemm.pack_weight (panels
    [ceil(n / 16), K, 16] float32/bfloat16, n output columns) -> [M, n] in out_dtype; bias, if
    given, out_dtype [n]. None when unsupported."""
    lib = load()
    if lib is None or x.dtype not in _DTYPE_CODE or out_dtype not in _DTYPE_CODE or not _rows_ok(x):
        return None
    if panels.dtype not in _DTYPE_CODE or not panels.is_contiguous() or panels.shape[1] != x.shape[1]:
        return None
    if bias is not None and (bias.dtype != out_dtype or not bias.is_contiguous()):
        return None
    m, k = x.shape
    out = torch.empty((m, n), dtype=out_dtype)
    rc = lib.radixlm_float_linear(_DTYPE_CODE[x.dtype], _ptr(x), x.stride(0), m, k, _DTYPE_CODE[panels.dtype],
                                  _ptr(panels), n, _DTYPE_CODE[out_dtype], _ptr(bias) if bias is not None else None,
                                  _ptr(out), n, torch.get_num_threads())
    return out if rc == 0 else None


def bf16_gemm_available() -> bool:
    """Whether the library has the AVX512-BF16 GEMM (bf16_gemm.cpp)."""
    lib = load()
    return lib is not None and lib.radixlm_bf16_gemm_available() == 1


def bf16_gemm_amx() -> bool:
    """Whether this process's bf16 GEMMs run on AMX tiles (bf16_gemm_amx.h; RADIXLM_BF16_AMX=0
    keeps them on AVX512-BF16)."""
    lib = load()
    return lib is not None and lib.radixlm_bf16_gemm_amx() == 1


def _bf16_gemm_lib(x: torch.Tensor, panels: torch.Tensor) -> ctypes.CDLL | None:
    """The library, when the bf16 GEMM takes these rows and panels (bf16_linear and its argmax
    take the same inputs: the argmax must answer for exactly the GEMM it stands in for)."""
    lib = load()
    if lib is None or x.dtype != torch.bfloat16 or not _rows_ok(x):
        return None
    if panels.dtype != torch.bfloat16 or not panels.is_contiguous() or panels.shape[1] * 2 != x.shape[1]:
        return None
    return lib


def bf16_linear(x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None,
                out_dtype: torch.dtype, silu: bool = False) -> torch.Tensor | None:
    """x [M, K] bfloat16 (rows contiguous, K even) times a weight packed by bf16_gemm.pack_weight
    (panels [ceil(n / 64), K / 2, 64, 2] bfloat16, n output columns) -> [M, n] in out_dtype
    (float32/bfloat16); bias, if given, bfloat16 [n] (the weight's dtype). silu: a gate_up
    weight in the silu-gated panel order (n = 2I, whole panels) -> silu(gate) * up [M, n / 2]
    (bf16_gemm.cpp bf16_linear_silu). None when unsupported."""
    lib = _bf16_gemm_lib(x, panels)
    if lib is None or out_dtype not in _DTYPE_CODE:
        return None
    if bias is not None and (bias.dtype != torch.bfloat16 or not bias.is_contiguous()):
        return None
    m, k = x.shape
    n_out = n // 2 if silu else n
    out = torch.empty((m, n_out), dtype=out_dtype)
    fn = lib.radixlm_bf16_linear_silu if silu else lib.radixlm_bf16_linear
    rc = fn(_ptr(x), x.stride(0), m, k, _ptr(panels), n, _ptr(bias) if bias is not None else None,
            _DTYPE_CODE[out_dtype], _ptr(out), n_out, torch.get_num_threads())
    return out if rc == 0 else None


def bf16_linear_argmax(x: torch.Tensor, panels: torch.Tensor, n: int, n_cols: int) -> torch.Tensor | None:
    """bf16_linear(x, panels, n, None, bfloat16)[:, :n_cols].argmax(-1) without the output
    (int64 [M]; the first largest, a NaN first, as torch.argmax). None when unsupported (no
    AVX512-BF16, the GEMMs on AMX tiles, inputs bf16_linear would not take)."""
    lib = _bf16_gemm_lib(x, panels)
    if lib is None or not 0 < n_cols <= n:
        return None
    m, k = x.shape
    ids = torch.empty(m, dtype=torch.int64)
    rc = lib.radixlm_bf16_linear_argmax(_ptr(x), x.stride(0), m, k, _ptr(panels), n_cols, _ptr(ids),
                                        torch.get_num_threads())
    return ids if rc == 0 else None


class Int8Gemm:
    """A weight packed by int8_linear.pack_int8_weight bound to the native GEMM once, so that
    a call is one output allocation and one ctypes call: int8_linear() above re-checks and
    re-reads the same pointers every time (~5 us, and a decode step makes ~120 of these
    calls)."""
    __slots__ = ("_fn", "_argmax_fn", "_keep", "_packed", "_comp", "_scale", "n", "k", "n_out")

    def __init__(self, packed: torch.Tensor, comp: torch.Tensor, w_scale: torch.Tensor, n: int, k: int,
                 silu: bool = False) -> None:
        """silu: a gate_up weight in the silu-gated tile order; a call returns silu(gate) * up
        (n / 2 columns), as int8_linear(..., silu=True)."""
        lib = load()
        if lib is None or lib.radixlm_int8_linear_available() != 1:
            raise RuntimeError("the native int8 GEMM is not available in this build")
        for t in (packed, comp, w_scale):
            if t.device.type != "cpu" or not t.is_contiguous():
                raise ValueError("packed int8 weight tensors must be contiguous CPU tensors")
        if silu and n % 32 != 0:
            raise ValueError(f"a silu-gated weight has whole 32-column tiles, not {n} columns")
        self._fn = lib.radixlm_int8_linear_silu if silu else lib.radixlm_int8_linear
        self._argmax_fn = None if silu else lib.radixlm_int8_linear_argmax
        self._keep = (packed, comp, w_scale)  # the pointers below stay valid while this lives
        self._packed, self._comp, self._scale = packed.data_ptr(), comp.data_ptr(), w_scale.data_ptr()
        self.n, self.k = n, k
        self.n_out = n // 2 if silu else n

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
        """x [M, k] float32/bfloat16 with contiguous rows; out_dtype float32/bfloat16; bias None
        or a contiguous out_dtype [n] (the caller checks: see int8_linear.int8_linear)."""
        m = x.shape[0]
        out = torch.empty((m, self.n_out), dtype=out_dtype)
        self._fn(_DTYPE_CODE[x.dtype], x.data_ptr(), x.stride(0), m, self.k, self._packed, self._comp, self._scale,
                 self.n, _DTYPE_CODE[out_dtype], bias.data_ptr() if bias is not None else None, out.data_ptr(),
                 self.n_out, torch.get_num_threads())
        return out

    def argmax(self, x: torch.Tensor, n_cols: int) -> torch.Tensor | None:
        """int8_linear(x, no bias, float32).argmax(-1) over the first n_cols output columns,
        without the [M, n] output (torch.argmax's answer: the first largest, a NaN first).
        x as for __call__. None for a silu-gated weight or outside the columns 1 .. n."""
        if self._argmax_fn is None or not 0 < n_cols <= self.n:
            return None
        m = x.shape[0]
        ids = torch.empty(m, dtype=torch.int64)
        rc = self._argmax_fn(_DTYPE_CODE[x.dtype], x.data_ptr(), x.stride(0), m, self.k, self._packed, self._comp,
                             self._scale, n_cols, ids.data_ptr(), torch.get_num_threads())
        return ids if rc == 0 else None


def argmax_rows(x: torch.Tensor) -> torch.Tensor | None:
    """torch.argmax(x, dim=-1) of float32 x [B, V] with contiguous rows (int64 [B]). None when
    unsupported."""
    lib = load()
    if lib is None or x.dtype != torch.float32 or x.device.type != "cpu" or not _rows_ok(x) or x.shape[1] == 0:
        return None
    out = torch.empty(x.shape[0], dtype=torch.int64)
    lib.radixlm_argmax_rows(_ptr(x), x.stride(0), x.shape[0], x.shape[1], _ptr(out), torch.get_num_threads())
    return out


def decode_rows(req_to_token: torch.Tensor, rows: torch.Tensor, lens: torch.Tensor,
                total: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(indptr int64 [B + 1], indices int64 [total]): row b of the CSR is req_to_token[rows[b],
    :lens[b]] (kernels/indices.py's build_indptr + build_kv_indices). rows and lens int64 [B],
    total = sum(lens) (the caller has it as a Python int). None when unsupported, and for a
    row or length outside the table or a total that is not sum(lens)."""
    lib = load()
    if (lib is None or req_to_token.dtype != torch.int64 or not req_to_token.is_contiguous()
            or req_to_token.device.type != "cpu" or rows.dtype != torch.int64 or lens.dtype != torch.int64
            or not rows.is_contiguous() or not lens.is_contiguous()):
        return None
    b = rows.numel()
    indptr = torch.empty(b + 1, dtype=torch.int64)
    indices = torch.empty(total, dtype=torch.int64)
    if lib.radixlm_decode_rows(_ptr(req_to_token), req_to_token.shape[0], req_to_token.shape[1], _ptr(rows),
                               _ptr(lens), b, _ptr(indptr), _ptr(indices), total) != 0 or int(indptr[-1]) != total:
        return None
    return indptr, indices


def common_prefix(req_to_token: torch.Tensor, rows: torch.Tensor, limit: int) -> int | None:
    """How many leading entries (<= limit, within the table's width) the table's rows `rows`
    (int64, at least one) have in common. None when unsupported."""
    lib = load()
    if (lib is None or req_to_token.dtype != torch.int64 or not req_to_token.is_contiguous()
            or req_to_token.device.type != "cpu" or rows.dtype != torch.int64 or not rows.is_contiguous()
            or rows.numel() == 0):
        return None
    n = lib.radixlm_common_prefix(_ptr(req_to_token), req_to_token.shape[0], req_to_token.shape[1], _ptr(rows),
                                  rows.numel(), limit)
    return None if n < 0 else n
