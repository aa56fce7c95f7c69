"""The int8 KV cache (--kv-cache-dtype int8): quantize_kv / dequantize_kv, the int8 pool's
storage and sizing, the server argument, and attention over an int8 pool.

Attention is checked two ways, per backend: against the same backend over a float pool that
holds exactly the dequantized values (equal up to float rounding: every read of the int8
pool, the extend's own new tokens included, must go through the dequantized cache), and
against the same backend over a float pool with the unrounded K/V (close: int8 error only).
"""
from __future__ import annotations

import argparse
import math

import pytest
import torch

from radixlm.config import ModelConfig, ServerArgs
from radixlm.kernels.cpu import ops as cpu_ops
from radixlm.srt.model_runner.attention.base import create_attention_backend
from radixlm.srt.model_runner.forward_batch import ForwardBatch, ForwardMode
from radixlm.srt.model_runner.kv_pool import KV_CACHE_DTYPES, MHATokenToKVPool, dequantize_kv, quantize_kv

H, HKV, D, CAP, CTX = 8, 2, 16, 512, 256

BACKENDS = ["torch_native", pytest.param("cpu", marks=pytest.mark.skipif(
    not cpu_ops.available(), reason="native CPU kernels could not be built"))]


def _rand_kv(n: int, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    """[n, HKV, D] with per-row magnitudes spread over several decades."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, HKV, D, generator=g) * torch.logspace(-3, 2, n * HKV).view(n, HKV, 1)
    return x.to(dtype)


# ---------------------------------------------------------------- quantize / dequantize
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_error_is_at_most_half_a_step(dtype):
    x = _rand_kv(64, dtype=dtype if dtype != torch.float16 else torch.float32).to(dtype)
    q, s = quantize_kv(x)
    assert q.dtype == torch.int8 and q.shape == x.shape
    assert s.dtype == torch.float32 and s.shape == x.shape[:2]
    assert int(q.abs().max()) <= 127
    back = dequantize_kv(q, s, torch.float32)
    err = (back.double() - x.double()).abs()
    # Half a quantization step, plus float32 rounding of x * (127 / amax) and of q * scale.
    bound = s.double()[..., None] / 2 * (1 + 1e-5) + x.double().abs() * 1e-6
    assert bool((err <= bound).all()), float((err - bound).max())
    # The largest magnitude of every row maps to +-127 (the full range is used).
    assert bool((q.abs().amax(-1) == 127).all())


def test_scale_is_amax_over_127_rounded_once_from_float64():
    x = _rand_kv(32, seed=3)
    q, s = quantize_kv(x)
    amax = x.abs().amax(-1).double()
    assert torch.equal(s, (amax / 127.0).float())
    inv = (127.0 / amax).float()
    assert torch.equal(q, torch.round(x * inv[..., None]).clamp(-127, 127).to(torch.int8))
    # round half to even, in float32: 0.5 -> 0, 1.5 -> 2, 2.5 -> 2
    row = torch.zeros(1, 1, D)
    row[0, 0, :4] = torch.tensor([127.0, 0.5, 1.5, 2.5])
    qr, sr = quantize_kv(row)
    assert sr.item() == 1.0 and qr[0, 0, :4].tolist() == [127, 0, 2, 2]


def test_zero_rows_have_zero_scale_and_values():
    x = _rand_kv(4, seed=5)
    x[1, 0] = 0
    x[3] = 0
    q, s = quantize_kv(x)
    assert s[1, 0] == 0 and s[3].eq(0).all() and s[1, 1] > 0
    assert q[1, 0].eq(0).all() and q[3].eq(0).all()
    back = dequantize_kv(q, s, torch.bfloat16)
    assert back.dtype == torch.bfloat16 and back[1, 0].eq(0).all() and back[3].eq(0).all()
    assert torch.isfinite(back).all()


def test_bfloat16_input_quantizes_like_its_float32_value():
    x = _rand_kv(16, seed=7, dtype=torch.bfloat16)
    q1, s1 = quantize_kv(x)
    q2, s2 = quantize_kv(x.float())
    assert torch.equal(q1, q2) and torch.equal(s1, s2)


def test_dequantize_is_q_times_scale_in_float32_then_cast():
    q, s = quantize_kv(_rand_kv(8, seed=9))
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(dequantize_kv(q, s, dtype), (q.float() * s[..., None]).to(dtype))


# ---------------------------------------------------------------- the pool
def test_int8_pool_layout_set_and_gather():
    pool = MHATokenToKVPool(10, 3, HKV, D, torch.bfloat16, "cpu", kv_cache_dtype="int8")
    assert pool.quantized and pool.dtype == torch.int8 and pool.compute_dtype == torch.bfloat16
    assert pool.kv_cache_dtype == "int8"
    assert len(pool.k_buffer) == len(pool.v_buffer) == len(pool.k_scale) == len(pool.v_scale) == 3
    assert pool.k_buffer[0].shape == (11, HKV, D) and pool.k_buffer[0].dtype == torch.int8
    assert pool.k_scale[0].shape == (11, HKV) and pool.k_scale[0].dtype == torch.float32
    assert all(b[0].eq(0).all() for b in pool.slot_buffers())  # the padding row
    loc = torch.tensor([3, 7, 1])
    k, v = _rand_kv(3, seed=1), _rand_kv(3, seed=2)
    pool.set_kv(2, loc, k, v)
    kq, ks = quantize_kv(k)
    vq, vs = quantize_kv(v)
    assert torch.equal(pool.k_buffer[2][loc], kq) and torch.equal(pool.v_buffer[2][loc], vq)
    assert torch.equal(pool.k_scale[2][loc], ks) and torch.equal(pool.v_scale[2][loc], vs)
    idx = torch.tensor([7, 0, 3, 3])
    gk = pool.gather_kv(2, idx, 0)
    assert gk.dtype == torch.bfloat16 and gk.shape == (4, HKV, D)
    assert torch.equal(gk, dequantize_kv(pool.k_buffer[2][idx], pool.k_scale[2][idx], torch.bfloat16))
    assert gk[1].eq(0).all()  # slot 0 reads as zeros
    assert torch.equal(pool.gather_kv(2, idx, 1),
                       dequantize_kv(pool.v_buffer[2][idx], pool.v_scale[2][idx], torch.bfloat16))
    torch.testing.assert_close(gk[0].float(), k[1], atol=float(ks[1].max()), rtol=1e-2)


def test_float_pool_gather_kv_and_out():
    pool = MHATokenToKVPool(10, 1, HKV, D, torch.float32, "cpu")
    assert not pool.quantized and pool.dtype == pool.compute_dtype == torch.float32
    assert pool.slot_buffers() == [*pool.k_buffer, *pool.v_buffer]
    loc = torch.tensor([2, 5])
    k, v = _rand_kv(2, seed=4), _rand_kv(2, seed=6)
    pool.set_kv(0, loc, k, v)
    assert torch.equal(pool.gather_kv(0, loc, 0), k) and torch.equal(pool.gather_kv(0, loc, 1), v)
    out = torch.empty(2, HKV, D)
    assert pool.gather_kv(0, loc, 1, out=out).data_ptr() == out.data_ptr() and torch.equal(out, v)


def test_sizes_and_bytes_per_token():
    layers = 3
    int8 = MHATokenToKVPool.bytes_per_token(layers, HKV, D, torch.bfloat16, "int8")
    assert int8 == 2 * layers * HKV * (D + 4)
    assert MHATokenToKVPool.bytes_per_token(layers, HKV, D, torch.bfloat16) == 2 * layers * HKV * D * 2
    # the dtype does not matter for int8 storage
    assert MHATokenToKVPool.bytes_per_token(layers, HKV, D, torch.float32, "int8") == int8
    pool = MHATokenToKVPool(10, layers, HKV, D, torch.bfloat16, "cpu", kv_cache_dtype="int8")
    assert len(pool.slot_buffers()) == 4 * layers
    assert pool.allocated_bytes == pool.total_bytes() == 11 * int8
    # head_dim 64 (SmolLM2): int8 + scale is 68 bytes per head against 128 in bf16
    assert MHATokenToKVPool.bytes_per_token(30, 3, 64, torch.bfloat16) / \
        MHATokenToKVPool.bytes_per_token(30, 3, 64, torch.bfloat16, "int8") == pytest.approx(128 / 68)


def test_release_and_allocate():
    pool = MHATokenToKVPool(10, 2, HKV, D, torch.float32, "cpu", kv_cache_dtype="int8")
    full = pool.allocated_bytes
    pool.set_kv(0, torch.tensor([1]), _rand_kv(1), _rand_kv(1))
    pool.release()
    assert pool.allocated_bytes == 0 and len(pool.slot_buffers()) == 8
    assert all(b.shape[0] == 0 for b in pool.slot_buffers())
    assert pool.k_scale[0].dtype == torch.float32 and pool.k_buffer[0].dtype == torch.int8
    pool.allocate()
    assert pool.allocated_bytes == full
    assert pool.k_scale[1].shape == (11, HKV) and all(b[0].eq(0).all() for b in pool.slot_buffers())


def test_bad_kv_cache_dtype_is_refused():
    assert KV_CACHE_DTYPES == ("auto", "int8")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        MHATokenToKVPool(10, 1, HKV, D, torch.float32, "cpu", kv_cache_dtype="fp8")


# ---------------------------------------------------------------- server argument
def test_server_args_kv_cache_dtype():
    assert ServerArgs().kv_cache_dtype == "auto"
    assert ServerArgs.from_kwargs(kv_cache_dtype="int8").kv_cache_dtype == "int8"
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        ServerArgs.from_kwargs(kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        ServerArgs(kv_cache_dtype="int4").verify()
    ap = argparse.ArgumentParser()
    ServerArgs.add_cli_args(ap)
    assert ServerArgs.from_cli_args(ap.parse_args(["--kv-cache-dtype", "int8"])).kv_cache_dtype == "int8"
    assert ServerArgs.from_cli_args(ap.parse_args([])).kv_cache_dtype == "auto"
    with pytest.raises(SystemExit):
        ap.parse_args(["--kv-cache-dtype", "fp8"])


def test_resolve_sizes_fits_more_int8_tokens(monkeypatch):
    from radixlm.srt.model_runner import runner
    monkeypatch.setattr(runner, "_available_memory_bytes", lambda device: 1 << 30)
    cfg = ModelConfig(num_hidden_layers=30, num_key_value_heads=3, head_dim=64)
    args = ServerArgs(mem_fraction_static=0.01)
    auto = runner.resolve_sizes(args.runner_config(), cfg, "cpu", torch.bfloat16).max_total_tokens
    int8 = runner.resolve_sizes(args.replace(kv_cache_dtype="int8").runner_config(), cfg, "cpu",
                                torch.bfloat16).max_total_tokens
    assert auto == int(0.01 * (1 << 30) / (2 * 30 * 3 * 64 * 2))
    assert int8 == int(0.01 * (1 << 30) / (2 * 30 * 3 * 68))
    assert int8 / auto == pytest.approx(128 / 68, rel=1e-3)


def test_gpu_backends_refuse_an_int8_pool():
    pool = MHATokenToKVPool(16, 1, HKV, D, torch.bfloat16, "cpu", kv_cache_dtype="int8")
    # flashinfer checks before importing flashinfer or looking for a GPU
    with pytest.raises(ValueError, match="cpu and torch_native"):
        create_attention_backend("flashinfer", pool, H, HKV, D)
    pytest.importorskip("triton")
    with pytest.raises(ValueError, match="cpu and torch_native"):
        create_attention_backend("triton", pool, H, HKV, D)


# ---------------------------------------------------------------- attention over an int8 pool
class _Twins:
    """The same K/V sequence written to three pools, each with its own backend: `int8` (an
    int8 pool), `deq` (a float pool given the dequantized K/V) and `raw` (a float pool given
    the K/V as they are)."""

    def __init__(self, backend: str, dtype: torch.dtype, heads: int = H, kv_heads: int = HKV, dim: int = D) -> None:
        self.dtype = dtype
        self.heads, self.kv_heads, self.dim = heads, kv_heads, dim
        self.pools = {"int8": MHATokenToKVPool(CAP, 1, kv_heads, dim, dtype, "cpu", kv_cache_dtype="int8"),
                      "deq": MHATokenToKVPool(CAP, 1, kv_heads, dim, dtype, "cpu"),
                      "raw": MHATokenToKVPool(CAP, 1, kv_heads, dim, dtype, "cpu")}
        # Never-written slots hold garbage: it must not leak through masked padding.
        for name, p in self.pools.items():
            if name == "int8":
                p.k_buffer[0][1:] = 77
                p.v_buffer[0][1:] = -77
                p.k_scale[0][1:] = float("nan")
                p.v_scale[0][1:] = float("nan")
            else:
                p.k_buffer[0][1:] = float("nan")
                p.v_buffer[0][1:] = float("nan")
        self.backends = {n: create_attention_backend(backend, p, heads, kv_heads, dim) for n, p in self.pools.items()}
        # The cpu backend's int8 kernel (head dims 64/128/256) also quantizes the query per
        # head, so it matches the dequantized pool to int8 rounding rather than float rounding.
        self.quantized_query = getattr(self.backends["int8"], "native_decode", False)
        self.req_to_token = torch.randint(0, CAP + 1, (8, CTX))  # garbage beyond each seq_len
        self.free = torch.randperm(CAP) + 1
        self.used = 0
        self.lens: dict[int, int] = {}
        self.gen = torch.Generator().manual_seed(0)
        self.metas: dict = {}

    def step(self, mode: ForwardMode, rows: list[int], ext: list[int]) -> dict[str, torch.Tensor]:
        prefix = [self.lens.get(r, 0) for r in rows]
        n = sum(ext)
        loc = self.free[self.used:self.used + n]
        self.used += n
        start = 0
        for r, p, e in zip(rows, prefix, ext):
            self.req_to_token[r, p:p + e] = loc[start:start + e]
            self.lens[r] = p + e
            start += e
        q = torch.randn(n, self.heads, self.dim, generator=self.gen).to(self.dtype)
        k = (torch.randn(n, self.kv_heads, self.dim, generator=self.gen) * 2).to(self.dtype)
        v = torch.randn(n, self.kv_heads, self.dim, generator=self.gen).to(self.dtype)
        kd = dequantize_kv(*quantize_kv(k), self.dtype)
        vd = dequantize_kv(*quantize_kv(v), self.dtype)
        outs = {}
        for name, backend in self.backends.items():
            fb = ForwardBatch.build(mode, [0] * n, loc, rows, prefix, ext, self.req_to_token)
            backend.init_forward_metadata(fb)
            self.metas[name] = fb.attn_metadata
            kk, vv = (kd, vd) if name == "deq" else (k, v)
            outs[name] = backend.forward(q, kk, vv, 0, fb, self.dim ** -0.5)
        return outs

    def share_prefix(self, src: int, rows: list[int], n: int) -> None:
        """rows start with src's first n slots, as a radix hit hands them out."""
        for r in rows:
            self.req_to_token[r, :n] = self.req_to_token[src, :n]
            self.lens[r] = n


def _check(twins: _Twins, outs: dict[str, torch.Tensor]) -> None:
    exact = 2e-5 if twins.dtype == torch.float32 else 2e-2
    atol = 6e-2 if twins.quantized_query else exact  # scores off by the query's int8 rounding
    assert outs["int8"].dtype == twins.dtype and torch.isfinite(outs["int8"]).all()
    # the int8 pool attends to exactly the dequantized values
    torch.testing.assert_close(outs["int8"].float(), outs["deq"].float(), atol=atol, rtol=3e-2 if twins.quantized_query else exact)
    # ... which are within int8 rounding of the real ones
    err = (outs["int8"].double() - outs["raw"].double()).abs().max().item()
    assert err < (8e-2 if twins.quantized_query else 5e-2), err


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extend_and_decode_over_an_int8_pool(backend, dtype):
    t = _Twins(backend, dtype)
    _check(t, t.step(ForwardMode.EXTEND, [0, 1, 2], [7, 1, 20]))  # no cached prefix
    _check(t, t.step(ForwardMode.EXTEND, [0, 3, 2], [5, 90, 1]))  # rows 0 and 2 over their prefix
    for _ in range(3):
        _check(t, t.step(ForwardMode.DECODE, [2, 0, 1, 3], [1, 1, 1, 1]))
    _check(t, t.step(ForwardMode.DECODE, [3], [1]))  # one request


@pytest.mark.parametrize("backend", BACKENDS)
def test_grouped_decode_over_an_int8_pool(backend):
    t = _Twins(backend, torch.float32)
    for b in t.backends.values():
        b.call_cost_keys, b.max_group_keys = 8.0, 64  # several decode groups (torch_native's plan)
    rows = list(range(8))
    _check(t, t.step(ForwardMode.EXTEND, rows, [3, 40, 7, 7, 90, 1, 25, 26]))
    _check(t, t.step(ForwardMode.DECODE, rows[::-1], [1] * 8))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shared_prefix_decode_and_extend_over_an_int8_pool(backend, dtype):
    t = _Twins(backend, dtype)
    _check(t, t.step(ForwardMode.EXTEND, [0], [100]))
    t.share_prefix(0, [1, 2, 3], 100)
    # extends over the common 100-slot prefix: torch's paths (torch_native, and the cpu backend
    # where this shape has no native kernel) as one shared-prefix decode; the native kernel
    # reads every request's whole keys (no cascade)
    def shared_ok() -> bool:
        meta = t.metas["int8"]
        if type(meta).__name__ == "_NativeDecode":
            return not hasattr(meta, "shared_index")
        return meta.shared_index is not None and meta.shared_index.numel() == 100

    _check(t, t.step(ForwardMode.EXTEND, [1, 2, 3], [1, 9, 30]))
    assert shared_ok()
    for _ in range(2):
        _check(t, t.step(ForwardMode.DECODE, [3, 0, 2, 1], [1] * 4))
        assert shared_ok()


@pytest.mark.skipif(not cpu_ops.decode_int8_supported(9, 3, 64), reason="no native int8 decode in this build")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_backend_native_int8_kernels(dtype):
    """SmolLM2's attention shape (9 query heads, 3 KV heads, head_dim 64): the cpu backend
    stores and attends through kv_int8_ops.cpp (decode, short extends as decode rows, long
    extends through the dequantized pool, decode over a shared prefix: no cascade)."""
    t = _Twins("cpu", dtype, heads=9, kv_heads=3, dim=64)
    assert t.quantized_query
    _check(t, t.step(ForwardMode.EXTEND, [0, 1, 2], [7, 1, 20]))  # short extends: native rows
    assert type(t.metas["int8"]).__name__ == "_NativeDecode"
    _check(t, t.step(ForwardMode.EXTEND, [0, 3], [5, 90]))  # a long extend: torch over gather_kv
    for _ in range(2):
        _check(t, t.step(ForwardMode.DECODE, [2, 0, 1, 3], [1, 1, 1, 1]))
    t.share_prefix(3, [4, 5, 6], 90)
    _check(t, t.step(ForwardMode.DECODE, [4, 5, 6], [1, 1, 1]))
    assert type(t.metas["int8"]).__name__ == "_NativeDecode"  # every request's whole row, the prefix too
    # what the kernel stored is what quantize_kv gives (bit for bit)
    k_all = t.pools["raw"].k_buffer[0]
    loc = t.req_to_token[0, :12]
    ref_q, ref_s = quantize_kv(k_all[loc])
    assert torch.equal(t.pools["int8"].k_buffer[0][loc], ref_q)
    assert torch.equal(t.pools["int8"].k_scale[0][loc], ref_s)


def test_torch_native_float_pool_path_unchanged():
    """A float pool still reads through the reused workspace (no per-read allocation)."""
    t = _Twins("torch_native", torch.float32)
    t.step(ForwardMode.EXTEND, [0, 1], [30, 40])
    t.step(ForwardMode.DECODE, [0, 1], [1, 1])
    ws = t.backends["raw"]._workspace
    assert ws[0] is not None and ws[1] is not None
    assert t.backends["int8"]._workspace == [None, None]  # int8 reads go through gather_kv


def test_int8_extend_ignores_the_unrounded_new_kv():
    """A prompt's attention sees its own K/V as stored: same output whether the whole prompt
    is one extend or its first part was cached (the radix hit / chunked prefill case)."""
    gen = torch.Generator().manual_seed(11)
    n = 24
    q = torch.randn(n, H, D, generator=gen)
    k = torch.randn(n, HKV, D, generator=gen)
    v = torch.randn(n, HKV, D, generator=gen)
    outs = []
    for split in (0, 16):
        pool = MHATokenToKVPool(64, 1, HKV, D, torch.float32, "cpu", kv_cache_dtype="int8")
        be = create_attention_backend("torch_native", pool, H, HKV, D)
        table = torch.arange(1, 65)[None].repeat(2, 1)
        out = []
        for lo, hi in ((0, split), (split, n)):
            if hi == lo:
                continue
            fb = ForwardBatch.build(ForwardMode.EXTEND, [0] * (hi - lo), table[0, lo:hi], [0], [lo], [hi - lo], table)
            be.init_forward_metadata(fb)
            out.append(be.forward(q[lo:hi], k[lo:hi], v[lo:hi], 0, fb, D ** -0.5))
        outs.append(torch.cat(out))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    assert not math.isnan(outs[0].sum().item())
