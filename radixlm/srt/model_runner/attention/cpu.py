"""Attention on the native CPU kernels (radixlm/kernels/cpu): the default backend on CPU
when the kernels build.

DECODE: one C call per layer over CSR indices built once per forward (kv_indptr /
kv_indices from the request-to-token table): no gather of K/V into padded blocks, no
padding work, no block-diagonal FLOPs (see torch_native's _decode_group for what that
replaces), each request's keys read straight from the pool. A radix prefix shared by the
whole batch (system prompt, n > 1 samples) is read by the kernel in every request's row too:
a cascade (the prefix by one torch GEMM per KV head over all query rows, merged with the
kernel's suffixes by log-sum-exp; torch_native still does it) measured 1.4-1.7x slower per
decode step at batch 32-128 with 200- to 4,000-token shared prefixes, and kept the step off
the fused layers.

EXTEND: when every request extends by a few tokens (<= SHORT_EXTEND: chat turns, short
prompts, a batch of small prefills), each new token is a decode-style row over its causal
keys (its cached prefix and the new tokens up to itself) and the whole batch is one kernel
call per layer; torch_native's path made one SDPA call per request per layer (~80 us each,
32 requests x 30 layers per prefill batch). Longer extends, when the model computes in bf16
on a CPU with AVX512-BF16, are one call of the native prefill kernel per layer
(extend_attention.cpp: packed K/V tiles, causal blocks skipped, the cached prefix read
unmasked; 3-4x torch's SDPA at a 2k prompt's chunk shapes), over a bf16 or an int8 pool (whose
rows it dequantizes while packing); elsewhere they take torch_native's SDPA path. The KV store
is one C call (row copies) instead of two index_copy_.

SLIDING-WINDOW layers (Gemma 2/3: a query at position p sees keys p - W < j <= p) run on the
same kernels: long extends on the prefill kernel with its window (keys before it neither packed
nor read), the rest on the decode kernel with each new token one CSR row over its window (built
once per forward, masked.window_rows; also float32 long extends, which full layers give torch's
SDPA). Soft-capped scores (Gemma 2) are not in the kernels: those layers attend in torch
(masked.py).

An int8 pool (--kv-cache-dtype int8) is stored and attended by the kernels of
kv_int8_ops.cpp (quantize on store; int8 scores, float P @ V); its shared prefix (and long
extends without the prefill kernel) are dequantized by the pool (gather_kv) for the torch paths.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from radixlm.kernels.cpu import ops as cpu_ops
from radixlm.kernels.indices import build_indptr, build_kv_indices
from radixlm.srt.model_runner.attention.base import ATTENTION_BACKENDS
from radixlm.srt.model_runner.attention.masked import window_rows
from radixlm.srt.model_runner.attention.torch_native import TorchNativeAttention
from radixlm.srt.model_runner.forward_batch import ForwardBatch, ForwardMode


@dataclass
class _NativeDecode:
    kv_indptr: torch.Tensor  # int64 [B + 1]
    kv_indices: torch.Tensor  # int64 [sum of key counts]


@dataclass
class _NativeExtend:
    q_indptr: torch.Tensor  # int64 [B + 1] over the new tokens
    kv_indptr: torch.Tensor  # int64 [B + 1] over each request's keys (prefix + new tokens)
    kv_indices: torch.Tensor  # int64 pool slots


SHORT_EXTEND = 64  # longest extend (new tokens of one request) taken as decode-style rows
MAX_SHORT_EXTEND_KEYS = 1 << 22  # bound on the per-row key lists (int64 indices)


@ATTENTION_BACKENDS.register("cpu")
class CpuNativeAttention(TorchNativeAttention):
    def __init__(self, kv_pool, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__(kv_pool, num_heads, num_kv_heads, head_dim)
        if not cpu_ops.available():
            raise ValueError("the cpu attention backend needs the native CPU kernels, which could not be "
                             "built (is a C++ compiler installed? see the log); use torch_native")
        # Shapes and dtypes the kernels are not instantiated for (e.g. float16, or an int8
        # pool on a CPU without AVX512-VNNI) decode through torch_native.
        self.quantized = getattr(kv_pool, "quantized", False)
        if self.quantized:
            self.native_decode = cpu_ops.decode_int8_supported(num_heads, num_kv_heads, head_dim)
        else:
            self.native_decode = (cpu_ops.decode_supported(num_heads, num_kv_heads, head_dim)
                                  and kv_pool.dtype in (torch.float32, torch.bfloat16))
        self.native_extend = (getattr(kv_pool, "compute_dtype", kv_pool.dtype) == torch.bfloat16
                              and cpu_ops.extend_attention_supported(num_heads, num_kv_heads, head_dim))
        # The forward whose sliding-window rows _windows holds (window -> rows, or None).
        self._windows_of: ForwardBatch | None = None
        self._windows: dict[int, _NativeDecode | None] = {}

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        if fb.req_to_token.device.type != "cpu" or not self.native_decode:
            super().init_forward_metadata(fb)
            return
        if fb.mode != ForwardMode.DECODE:
            if not self._init_short_extend(fb) and not self._init_native_extend(fb):
                super().init_forward_metadata(fb)
            return
        lens = fb.seq_lens_cpu
        rows = fb.req_pool_indices
        native = cpu_ops.decode_rows(fb.req_to_token, rows, fb.seq_lens, sum(lens))
        if native is not None:  # the same rows in one native pass (torch: ~0.1 ms at batch 32)
            fb.attn_metadata = _NativeDecode(*native)
            return
        fb.attn_metadata = _NativeDecode(build_indptr(fb.seq_lens, torch.int64),  # seq_lens is int64
                                         build_kv_indices(fb.req_to_token, rows, fb.seq_lens, max(lens)))

    def _common_slots(self, fb: ForwardBatch, limit: int) -> int:
        n = cpu_ops.common_prefix(fb.req_to_token, fb.req_pool_indices, limit)
        return super()._common_slots(fb, limit) if n is None else n

    def decode_rows(self, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(kv_indptr, kv_indices) when this forward's attention is the decode kernel over one
        CSR row per token, as forward() runs it (a decode step or short extends), else None:
        what a caller that runs the whole layer natively (models/fused_decode.py) may do in its
        place."""
        meta = fb.attn_metadata
        if not isinstance(meta, _NativeDecode):
            return None
        return meta.kv_indptr, meta.kv_indices

    def extend_rows(self, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(q_indptr, kv_indptr, kv_indices) when this forward's attention is the prefill kernel
        over each request's keys, as forward() runs it, else None (models/fused_decode.py)."""
        meta = fb.attn_metadata
        if not isinstance(meta, _NativeExtend):
            return None
        return meta.q_indptr, meta.kv_indptr, meta.kv_indices

    def rows_indptr(self, fb: ForwardBatch, rows: torch.Tensor) -> torch.Tensor | None:
        """The q_indptr forward_rows gives the prefill kernel for `rows` (each request's last
        tokens, in order), or None where forward_rows takes another path."""
        if not isinstance(fb.attn_metadata, _NativeExtend):
            return None
        counts = _trailing_counts(rows.tolist(), fb.extend_seq_lens_cpu)
        return None if counts is None else build_indptr(torch.tensor(counts, dtype=torch.int64), torch.int64)

    def _init_short_extend(self, fb: ForwardBatch) -> bool:
        """Token t of a request at position pos attends to its first pos + 1 slots: one CSR
        row per new token. False (torch_native's path) for long extends."""
        ext = fb.extend_seq_lens_cpu
        if not ext or max(ext) > SHORT_EXTEND:
            return False
        key_lens = fb.positions + 1
        if int(key_lens.sum()) > MAX_SHORT_EXTEND_KEYS:
            return False
        rows = torch.repeat_interleave(fb.req_pool_indices, fb.extend_seq_lens)
        indices = build_kv_indices(fb.req_to_token, rows, key_lens, max(fb.seq_lens_cpu))
        fb.attn_metadata = _NativeDecode(build_indptr(key_lens, torch.int64), indices)
        return True

    def _init_native_extend(self, fb: ForwardBatch) -> bool:
        """Long extends on the prefill kernel: each request's keys are its first seq_len slots."""
        if not self.native_extend or not fb.extend_seq_lens_cpu:
            return False
        keys = build_kv_indices(fb.req_to_token, fb.req_pool_indices, fb.seq_lens, max(fb.seq_lens_cpu))
        fb.attn_metadata = _NativeExtend(build_indptr(fb.extend_seq_lens, torch.int64),
                                         build_indptr(fb.seq_lens, torch.int64), keys)
        return True

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                fb: ForwardBatch, scale: float, window: int | None = None,
                softcap: float | None = None) -> torch.Tensor:
        if window is not None or softcap is not None:
            return self._forward_masked(q, k, v, layer_id, fb, scale, window, softcap)
        meta = fb.attn_metadata
        if not isinstance(meta, (_NativeDecode, _NativeExtend)):
            return super().forward(q, k, v, layer_id, fb, scale)
        self._store(layer_id, k, v, fb.out_cache_loc)
        if isinstance(meta, _NativeExtend):
            return self._extend_native(q, layer_id, meta, scale)
        return self._attend_rows(q, layer_id, meta, scale)

    def forward_rows(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                     fb: ForwardBatch, scale: float, rows: torch.Tensor, window: int | None = None,
                     softcap: float | None = None) -> torch.Tensor:
        """On the prefill kernel, when the rows are each request's last tokens (what sampling
        needs), only their queries are attended: the kernel takes them as the requests' new
        tokens, each seeing its own causal keys."""
        meta = fb.attn_metadata
        q_indptr = self.rows_indptr(fb, rows) if softcap is None else None
        if q_indptr is None:
            if window is not None or softcap is not None:
                return self.forward(q, k, v, layer_id, fb, scale, window, softcap).index_select(0, rows)
            return super().forward_rows(q, k, v, layer_id, fb, scale, rows)
        self._store(layer_id, k, v, fb.out_cache_loc)
        own = _NativeExtend(q_indptr, meta.kv_indptr, meta.kv_indices)
        return self._extend_native(q.index_select(0, rows), layer_id, own, scale, window)

    def _forward_masked(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                        fb: ForwardBatch, scale: float, window: int | None, softcap: float | None) -> torch.Tensor:
        """A sliding-window layer on the prefill kernel with its window (long extends) or on the
        decode kernel, each new token one CSR row over its window; soft-capped scores, which the
        kernels do not compute, in torch (masked.py), as are shapes the kernels do not take."""
        self._store(layer_id, k, v, fb.out_cache_loc)
        meta = fb.attn_metadata
        if softcap is None and isinstance(meta, _NativeExtend):  # long extends: the prefill kernel's window
            return self._extend_native(q, layer_id, meta, scale, window)
        rows = None
        if softcap is None and window is not None and self.native_decode and fb.req_to_token.device.type == "cpu":
            rows = self._window_rows(fb, window)
        if rows is None:
            return self._attend_masked(q, layer_id, fb, scale, window, softcap)
        return self._attend_rows(q, layer_id, rows, scale)

    def _window_rows(self, fb: ForwardBatch, window: int) -> _NativeDecode | None:
        """window_rows of this forward, built once for all its sliding layers; None (the torch
        path) past MAX_SHORT_EXTEND_KEYS indices."""
        if self._windows_of is not fb:
            self._windows_of, self._windows = fb, {}
        if window not in self._windows:
            keys = int((fb.positions + 1).clamp(max=window).sum())
            self._windows[window] = _NativeDecode(*window_rows(fb, window)) if keys <= MAX_SHORT_EXTEND_KEYS else None
        return self._windows[window]

    def _store(self, layer_id: int, k: torch.Tensor, v: torch.Tensor, loc: torch.Tensor) -> None:
        pool = self.kv_pool
        k_buf, v_buf = pool.get_kv(layer_id)
        if self.quantized:
            stored = cpu_ops.store_kv_int8(k, v, k_buf, v_buf, pool.k_scale[layer_id], pool.v_scale[layer_id], loc)
        else:
            stored = cpu_ops.store_kv(k, v, k_buf, v_buf, loc)
        if not stored:
            pool.set_kv(layer_id, loc, k, v)

    def _extend_native(self, q: torch.Tensor, layer_id: int, meta: _NativeExtend, scale: float,
                       window: int | None = None) -> torch.Tensor:
        """The prefill kernel over each request's keys (an int8 pool's with its scales), within
        `window` for a sliding layer."""
        pool = self.kv_pool
        k_buf, v_buf = pool.get_kv(layer_id)
        scales = {"k_scale": pool.k_scale[layer_id], "v_scale": pool.v_scale[layer_id]} if self.quantized else {}
        out = cpu_ops.extend_attention(q, k_buf, v_buf, meta.q_indptr, meta.kv_indptr, meta.kv_indices, scale,
                                       window=window, **scales)
        if out is None:
            raise RuntimeError(f"native extend attention rejected q {tuple(q.shape)} {q.dtype}")
        return out

    def _attend_rows(self, q: torch.Tensor, layer_id: int, meta: _NativeDecode, scale: float) -> torch.Tensor:
        """The kernel over the CSR rows of meta."""
        pool = self.kv_pool
        k_buf, v_buf = pool.get_kv(layer_id)
        if self.quantized:
            out = cpu_ops.decode_attention_int8(q, k_buf, v_buf, pool.k_scale[layer_id], pool.v_scale[layer_id],
                                                meta.kv_indptr, meta.kv_indices, scale)
        else:
            out = cpu_ops.decode_attention(q, k_buf, v_buf, meta.kv_indptr, meta.kv_indices, scale)
        if out is None:
            raise RuntimeError(f"native decode attention rejected q {tuple(q.shape)} {q.dtype}")
        return out


def _trailing_counts(rows: list[int], extend_lens: list[int]) -> list[int] | None:
    """How many of each request's last new tokens `rows` names, when it names exactly
    those, in batch order (None otherwise: prompt-logprob rows, repeats)."""
    counts, i, end = [], 0, 0
    for n in extend_lens:
        start, end = end, end + n
        j = i
        while j < len(rows) and start <= rows[j] < end:
            j += 1
        if rows[i:j] != list(range(end - (j - i), end)):
            return None
        counts.append(j - i)
        i = j
    return counts if i == len(rows) else None
