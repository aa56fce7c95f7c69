"""Attention on Triton kernels (radixlm.kernels): the default backend on CUDA.

Per forward, init_forward_metadata turns the request-to-token table into CSR indices
once (kv_indptr/kv_indices for decode; qo_indptr plus prefix indices for extend) and
every layer reuses them. Per layer: store the new K/V into the pool (one launch), then
  DECODE: split-KV decode kernel over the whole KV (current token included);
  EXTEND: extend kernel, prefix from the pool through the indices, new tokens from the
          k/v just computed (so it does not depend on the store having landed).

Runs on CPU tensors only under TRITON_INTERPRET=1 (tests); that variable must be set
before triton is first imported.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

try:
    from radixlm.kernels.decode_attention import choose_num_kv_splits, decode_attention_fwd
    from radixlm.kernels.extend_attention import extend_attention_fwd
    from radixlm.kernels.kv_ops import store_kv
except ModuleNotFoundError as e:  # re-raised as ImportError: create_attention_backend would
    if e.name != "triton":       # report a missing "triton" module as an unknown backend
        raise
    raise ImportError("the triton attention backend needs the `triton` package "
                      "(pip install 'radixlm[gpu]')") from e

from radixlm.kernels.indices import build_indptr
from radixlm.srt.model_runner.attention.base import ATTENTION_BACKENDS, AttentionBackend
from radixlm.srt.model_runner.device_tensor import to_device
from radixlm.srt.model_runner.forward_batch import ForwardBatch, ForwardMode
from radixlm.srt.model_runner.kv_pool import check_kv_cache_backend


@dataclass
class _DecodeMeta:
    out_cache_loc: torch.Tensor
    kv_indptr: torch.Tensor  # int32 [B + 1]
    kv_indices: torch.Tensor  # int64 [sum(seq_lens)] (>= 1 element)
    num_kv_splits: int


@dataclass
class _ExtendMeta:
    out_cache_loc: torch.Tensor
    qo_indptr: torch.Tensor  # int32 [B + 1]
    prefix_indptr: torch.Tensor  # int32 [B + 1]
    prefix_indices: torch.Tensor  # int64 [sum(prefix_lens)] (>= 1 element)
    max_extend_len: int


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@ATTENTION_BACKENDS.register("triton")
class TritonAttention(AttentionBackend):
    supports_window = False  # the kernels have no lower key bound; soft-capping they do (logit_cap)

    def __init__(self, kv_pool, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__(kv_pool, num_heads, num_kv_heads, head_dim)
        # Checked first (before any GPU/library check) so the message names the real problem.
        check_kv_cache_backend(getattr(kv_pool, "kv_cache_dtype", "auto"), "triton")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        self.device = torch.device(kv_pool.device)
        if self.device.type != "cuda" and not interpreter_enabled():
            raise ValueError("the triton attention backend needs a CUDA device "
                             "(or TRITON_INTERPRET=1, for tests)")
        self.logit_cap = 0.0  # > 0 applies cap * tanh(s / cap) (Gemma-2/Grok-style soft cap)
        # fp32 tiles are twice as large: smaller blocks keep them within shared memory.
        small = kv_pool.dtype == torch.float32 or head_dim > 128
        self.block_m = 32 if small else 64
        self.block_n = 32 if small else 64
        # Stage-1 programs wanted per decode step: ~2 per SM keeps every SM busy.
        if self.device.type == "cuda":
            sms = torch.cuda.get_device_properties(self.device).multi_processor_count
            self.target_programs = 2 * sms
        else:
            self.target_programs = 4  # interpreter: fewer programs run faster
        self.max_kv_splits = 16

    # ---- metadata: built once per forward, shared by every layer ----
    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        dev = self.device
        loc = fb.out_cache_loc.to(dev, torch.int64)
        if fb.mode == ForwardMode.DECODE:
            max_len = max(fb.seq_lens_cpu) if fb.seq_lens_cpu else 0
            indices = fb.host_kv_indices(fb.seq_lens_cpu)
            splits = choose_num_kv_splits(fb.batch_size, self.num_kv_heads, max_len, self.block_n,
                                          self.max_kv_splits, self.target_programs)
            fb.attn_metadata = _DecodeMeta(loc, build_indptr(fb.seq_lens.to(dev)), _nonempty(indices, dev),
                                           splits)
        else:
            indices = fb.host_kv_indices(fb.extend_prefix_lens_cpu)
            fb.attn_metadata = _ExtendMeta(
                loc, build_indptr(fb.extend_seq_lens.to(dev)), build_indptr(fb.extend_prefix_lens.to(dev)),
                _nonempty(indices, dev), max(fb.extend_seq_lens_cpu) if fb.extend_seq_lens_cpu else 0)

    # ---- compute ----
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                fb: ForwardBatch, scale: float, window: int | None = None,
                softcap: float | None = None) -> torch.Tensor:
        if window is not None:
            raise ValueError("the triton attention backend does not implement sliding-window attention; "
                             "use --attention-backend cpu or torch_native")
        cap = self.logit_cap if softcap is None else float(softcap)
        meta = fb.attn_metadata
        if not isinstance(meta, (_DecodeMeta, _ExtendMeta)):  # caller skipped init_forward_metadata
            self.init_forward_metadata(fb)
            meta = fb.attn_metadata
        k_buf, v_buf = self.kv_pool.get_kv(layer_id)
        store_kv(k_buf, v_buf, meta.out_cache_loc, k, v)
        if isinstance(meta, _DecodeMeta):
            return decode_attention_fwd(q, k_buf, v_buf, meta.kv_indptr, meta.kv_indices, scale,
                                        cap, meta.num_kv_splits, block_n=self.block_n)
        return extend_attention_fwd(q, k, v, k_buf, v_buf, meta.qo_indptr, meta.prefix_indptr,
                                    meta.prefix_indices, meta.max_extend_len, scale, cap,
                                    block_m=self.block_m, block_n=self.block_n)


def _nonempty(indices: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Move to the device; an empty index list becomes [0] (never read: every length is 0)
    so that kernels always get a real allocation behind the pointer."""
    if indices.numel() == 0:
        return torch.zeros(1, dtype=torch.int64, device=device)
    return to_device(indices, device)
