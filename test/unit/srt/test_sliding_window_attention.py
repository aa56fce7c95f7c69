"""Sliding-window and soft-capped attention of the CPU backends against a float64 reference.

The cpu backend runs a sliding layer on the native prefill kernel with its window (bf16 long
extends) or the decode kernel with one CSR row per query cut to its window (a decode step; short
extends; float32 long extends), and soft-capped layers in torch; torch_native runs both in
torch. Each batch mixes requests whose cached prefix is longer than the window with fresh ones,
over a pool whose slots are shuffled, so a wrong cut reads wrong keys.
"""
from __future__ import annotations

import pytest
import torch

from radixlm.kernels.cpu import ops as cpu_ops
from radixlm.srt.model_runner.attention.base import create_attention_backend
from radixlm.srt.model_runner.attention.cpu import SHORT_EXTEND, CpuNativeAttention, _NativeExtend
from radixlm.srt.model_runner.attention.masked import window_rows
from radixlm.srt.model_runner.forward_batch import ForwardBatch, ForwardMode
from radixlm.srt.model_runner.kv_pool import MHATokenToKVPool, dequantize_kv

H, HKV, D = 8, 2, 64
SCALE = 0.125
CAPACITY, MAX_CONTEXT = 1024, 256
# The kernels' float32 sums against float64; bf16 rounds K/V, q and (the prefill paths) P.
TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="native CPU kernels not built")


def _reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: list[int],
               window: int | None, softcap: float | None) -> torch.Tensor:
    """float64 attention of queries q [T, H, D] at `positions` over one request's keys [L, Hkv, D]."""
    q64, k64, v64 = q.double(), keys.double(), values.double()
    k64, v64 = k64.repeat_interleave(H // HKV, 1), v64.repeat_interleave(H // HKV, 1)
    scores = torch.einsum("thd,lhd->htl", q64, k64) * SCALE
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    pos = torch.tensor(positions)[:, None]
    kpos = torch.arange(keys.shape[0])[None, :]
    visible = kpos <= pos
    if window is not None:
        visible &= kpos > pos - window
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1)
    return torch.einsum("htl,lhd->thd", probs, v64)


class _Batch:
    """A pool whose requests have `prefix` cached tokens (random K/V in shuffled slots) and
    extend by `ext` new ones."""

    def __init__(self, dtype: torch.dtype, kv_cache_dtype: str, prefix: list[int], ext: list[int],
                 decode: bool, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.pool = MHATokenToKVPool(CAPACITY, 1, HKV, D, dtype, "cpu", kv_cache_dtype=kv_cache_dtype)
        self.req_to_token = torch.zeros((len(prefix) + 1, MAX_CONTEXT), dtype=torch.int64)
        free = torch.randperm(CAPACITY, generator=g)
        used = 0
        rows = list(range(1, len(prefix) + 1))
        for r, p in zip(rows, prefix):
            self.req_to_token[r, :p + 0] = free[used:used + p]
            used += p
        cached = free[:used]
        if used:
            self.pool.set_kv(0, cached, torch.randn(used, HKV, D, generator=g).to(dtype),
                             torch.randn(used, HKV, D, generator=g).to(dtype))
        loc = free[used:used + sum(ext)]
        start = 0
        for r, p, e in zip(rows, prefix, ext):
            self.req_to_token[r, p:p + e] = loc[start:start + e]
            start += e
        mode = ForwardMode.DECODE if decode else ForwardMode.EXTEND
        self.fb = ForwardBatch.build(mode, [5] * sum(ext), loc, rows, prefix, ext, self.req_to_token)
        self.q = torch.randn(sum(ext), H, D, generator=g).to(dtype)
        self.k = torch.randn(sum(ext), HKV, D, generator=g).to(dtype)
        self.v = torch.randn(sum(ext), HKV, D, generator=g).to(dtype)
        self.prefix, self.ext, self.rows = prefix, ext, rows

    def stored(self, row: int, n: int, which: int) -> torch.Tensor:
        """What the pool holds for the first n keys of `row` (dequantized), float32."""
        index = self.req_to_token[row, :n]
        if self.pool.quantized:
            buf = self.pool.k_buffer[0] if which == 0 else self.pool.v_buffer[0]
            scale = self.pool.k_scale[0] if which == 0 else self.pool.v_scale[0]
            return dequantize_kv(buf[index], scale[index], torch.float32)
        return self.pool.get_kv(0)[which][index].float()

    def check(self, out: torch.Tensor, window: int | None, softcap: float | None, tol: float) -> None:
        start = 0
        for r, p, e in zip(self.rows, self.prefix, self.ext):
            ref = _reference(self.q[start:start + e].float(), self.stored(r, p + e, 0), self.stored(r, p + e, 1),
                             list(range(p, p + e)), window, softcap)
            torch.testing.assert_close(out[start:start + e].double(), ref, atol=tol, rtol=0)
            start += e


# (prefix lengths, new tokens, decode?): cached prefixes shorter and longer than the window, a
# fresh request, and in the long case more new tokens than SHORT_EXTEND.
CASES = {
    "decode": ([3, 20, 77, 150], [1, 1, 1, 1], True),
    "short_extend": ([0, 9, 40, 100], [12, 5, 30, SHORT_EXTEND], False),
    "long_extend": ([0, 31, 120], [SHORT_EXTEND + 30, 90, 7], False),
}


@pytest.mark.parametrize("backend", ["cpu", "torch_native"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype,kv", [(torch.float32, "auto"), (torch.bfloat16, "auto"), (torch.bfloat16, "int8")])
@pytest.mark.parametrize("window,softcap", [(16, None), (1, None), (16, 3.0), (None, 3.0)])
def test_windowed_attention_matches_float64(backend, case, dtype, kv, window, softcap):
    if kv == "int8" and not cpu_ops.decode_int8_supported(H, HKV, D):
        pytest.skip("int8 decode kernel not available on this CPU")
    prefix, ext, decode = CASES[case]
    b = _Batch(dtype, kv, prefix, ext, decode, seed=len(case) + (window or 0))
    attn = create_attention_backend(backend, b.pool, H, HKV, D)
    attn.init_forward_metadata(b.fb)
    with torch.inference_mode():
        out = attn.forward(b.q, b.k, b.v, 0, b.fb, SCALE, window=window, softcap=softcap)
    tol = TOL[dtype] * (2 if kv == "int8" else 1)
    b.check(out, window, softcap, tol)
    if isinstance(attn, CpuNativeAttention) and softcap is None and window is not None:
        # The window went through a native kernel, not the torch fallback: the prefill kernel's
        # (bf16 long extends), else the decode kernel's rows.
        if isinstance(b.fb.attn_metadata, _NativeExtend):
            assert attn._windows_of is not b.fb
        else:
            assert attn._windows_of is b.fb and attn._windows[window] is not None


def test_rows_of_the_window_only():
    """window_rows: each new token's row holds the slots of its last `window` positions, in order."""
    table = torch.arange(40, dtype=torch.int64).view(2, 20) + 100  # row r, position p -> 100 + 20 r + p
    fb = ForwardBatch.build(ForwardMode.EXTEND, [5] * 4, torch.zeros(4, dtype=torch.int64), [1, 0], [2, 9], [2, 2],
                            table)
    indptr, slots = window_rows(fb, 4)
    assert indptr.tolist() == [0, 3, 7, 11, 15]
    assert slots.tolist() == [120, 121, 122, 120, 121, 122, 123, 106, 107, 108, 109, 107, 108, 109, 110]


def test_forward_rows_with_a_window():
    """The last layer's rows (each request's last token) see only their windows too."""
    b = _Batch(torch.bfloat16, "auto", [0, 50], [SHORT_EXTEND + 10, 80], False, seed=9)
    attn = create_attention_backend("cpu", b.pool, H, HKV, D)
    attn.init_forward_metadata(b.fb)
    rows = torch.tensor([SHORT_EXTEND + 9, SHORT_EXTEND + 10 + 79], dtype=torch.int64)
    with torch.inference_mode():
        out = attn.forward_rows(b.q, b.k, b.v, 0, b.fb, SCALE, rows, window=12)
    for i, (r, p, e) in enumerate(zip(b.rows, b.prefix, b.ext)):
        ref = _reference(b.q[rows[i]:rows[i] + 1].float(), b.stored(r, p + e, 0), b.stored(r, p + e, 1),
                         [p + e - 1], 12, None)
        torch.testing.assert_close(out[i:i + 1].double(), ref, atol=TOL[torch.bfloat16], rtol=0)


def test_gpu_backends_refuse_what_they_cannot_do():
    """triton has no lower key bound (its kernels do soft-cap); flashinfer's plans are per forward:
    both refuse a sliding-window model at start-up with a one-line reason."""
    from radixlm.config import ModelConfig
    from radixlm.srt.model_runner.attention.base import ATTENTION_BACKENDS, check_model_attention

    gemma3 = ModelConfig(architecture="Gemma3ForCausalLM", num_hidden_layers=2, sliding_window=8,
                         layer_types=("sliding_attention", "full_attention"))
    gemma2 = ModelConfig(architecture="Gemma2ForCausalLM", num_hidden_layers=2, attn_logit_softcapping=50.0)
    for name in ("triton", "flashinfer"):
        backend = ATTENTION_BACKENDS.get(name)
        with pytest.raises(ValueError, match="sliding-window attention"):
            check_model_attention(backend, name, gemma3)
        check_model_attention(backend, name, ModelConfig())  # Llama: fine
    check_model_attention(ATTENTION_BACKENDS.get("triton"), "triton", gemma2)  # logit_cap
    with pytest.raises(ValueError, match="soft-capping"):
        check_model_attention(ATTENTION_BACKENDS.get("flashinfer"), "flashinfer", gemma2)
    for name in ("cpu", "torch_native"):
        check_model_attention(ATTENTION_BACKENDS.get(name), name, gemma3)
        check_model_attention(ATTENTION_BACKENDS.get(name), name, gemma2)
