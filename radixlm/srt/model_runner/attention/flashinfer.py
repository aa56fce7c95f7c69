"""Attention on FlashInfer's paged-KV wrappers (page size 1 over the token-granular pool).

UNTESTED on the machine it was written on (no GPU, flashinfer not installed): it follows
FlashInfer's documented >= 0.2 Python API (plan/run); test/gpu/ checks it on CUDA.

The KV pool of one layer, [slots, Hkv, D], is viewed as FlashInfer's NHD paged cache
[num_pages, page_size=1, Hkv, D], so a request's page list is exactly its slot list
from the request-to-token table and every last page holds one token.
  DECODE: BatchDecodeWithPagedKVCacheWrapper over the whole KV (current token included).
  EXTEND: BatchPrefillWithPagedKVCacheWrapper, causal, over prefix + new tokens after
          the new K/V are stored; FlashInfer aligns the causal mask to the end of the KV,
          so new token i sees the prefix and new tokens 0..i.
plan() (host-side scheduling, a device sync) runs once per forward, on the first
layer's call, because sm_scale only arrives with forward(); every later layer only
runs. A backend instance serves one forward at a time (the wrappers hold one plan).

FlashInfer kernels take fp16/bf16 only, so a float32 KV pool is refused.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from radixlm.kernels.indices import build_indptr
from radixlm.srt.model_runner.attention.base import ATTENTION_BACKENDS, AttentionBackend
from radixlm.srt.model_runner.device_tensor import to_device
from radixlm.srt.model_runner.forward_batch import ForwardBatch, ForwardMode
from radixlm.srt.model_runner.kv_pool import check_kv_cache_backend

WORKSPACE_BYTES = 128 << 20  # FlashInfer's documented default workspace size


@dataclass
class _Meta:
    decode: bool
    loc: torch.Tensor  # int64 [T] slots of the new tokens
    qo_indptr: torch.Tensor | None  # int32 [B + 1] (extend only)
    kv_indptr: torch.Tensor  # int32 [B + 1]: pages (= tokens) per request
    kv_indices: torch.Tensor  # int32 [nnz]: page ids = pool slots
    kv_last_page_len: torch.Tensor  # int32 [B]: all 1 (page size 1)
    planned_scale: float | None = None  # the sm_scale the wrapper was planned with


@ATTENTION_BACKENDS.register("flashinfer")
class FlashInferAttention(AttentionBackend):
    # Its plans are per forward, not per layer: the sliding and global layers of one model would
    # need two of each; not done.
    supports_window = False
    supports_softcap = False

    def __init__(self, kv_pool, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__(kv_pool, num_heads, num_kv_heads, head_dim)
        # Checked first (before any GPU/library check) so the message names the real problem.
        check_kv_cache_backend(getattr(kv_pool, "kv_cache_dtype", "auto"), "flashinfer")
        try:
            import flashinfer
        except ImportError as e:  # plain ImportError: create_attention_backend reports a
            # ModuleNotFoundError named like the backend as "unknown backend"
            raise ImportError("the flashinfer attention backend needs the `flashinfer-python` "
                              "package (pip install 'radixlm[gpu]')") from e
        self.device = torch.device(kv_pool.device)
        if self.device.type != "cuda":
            raise ValueError("the flashinfer attention backend needs a CUDA device")
        if kv_pool.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"flashinfer kernels need a float16/bfloat16 KV pool, not {kv_pool.dtype}; "
                             "use --dtype float16/bfloat16 or --attention-backend triton")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        self.logit_cap = 0.0  # > 0: FlashInfer's logits_soft_cap
        # One workspace serves both wrappers: a forward is either decode or extend.
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self.prefill_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        # Tensor-core decode kernels pay off once several query heads share a KV head.
        self.decode_wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=num_heads // num_kv_heads >= 4)
        if not hasattr(self.decode_wrapper, "plan"):
            raise ImportError("flashinfer >= 0.2 is required (wrappers with plan()/run())")

    # ---- metadata ----
    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        dev = self.device
        decode = fb.mode == ForwardMode.DECODE
        indices = fb.host_kv_indices(fb.seq_lens_cpu, torch.int32)
        fb.attn_metadata = _Meta(
            decode=decode,
            loc=fb.out_cache_loc.to(dev, torch.int64),
            qo_indptr=None if decode else build_indptr(fb.extend_seq_lens.to(dev)),
            kv_indptr=build_indptr(fb.seq_lens.to(dev)),
            kv_indices=to_device(indices, dev),
            kv_last_page_len=torch.ones(fb.batch_size, dtype=torch.int32, device=dev))

    def _plan(self, meta: _Meta, q_dtype: torch.dtype, scale: float) -> None:
        cap = self.logit_cap if self.logit_cap > 0 else None
        common = (self.num_heads, self.num_kv_heads, self.head_dim, 1)  # ..., page_size
        if meta.decode:
            self.decode_wrapper.plan(meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len, *common,
                                     pos_encoding_mode="NONE", logits_soft_cap=cap, sm_scale=scale,
                                     q_data_type=q_dtype, kv_data_type=self.kv_pool.dtype)
        else:
            self.prefill_wrapper.plan(meta.qo_indptr, meta.kv_indptr, meta.kv_indices,
                                      meta.kv_last_page_len, *common, causal=True,
                                      logits_soft_cap=cap, sm_scale=scale,
                                      q_data_type=q_dtype, kv_data_type=self.kv_pool.dtype)
        meta.planned_scale = scale

    # ---- compute ----
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                fb: ForwardBatch, scale: float, window: int | None = None,
                softcap: float | None = None) -> torch.Tensor:
        if window is not None or softcap is not None:
            raise ValueError("the flashinfer attention backend does not implement sliding-window attention or "
                             "score soft-capping; use --attention-backend cpu or torch_native")
        meta = fb.attn_metadata
        if not isinstance(meta, _Meta):  # caller skipped init_forward_metadata
            self.init_forward_metadata(fb)
            meta = fb.attn_metadata
        if meta.planned_scale != scale:
            self._plan(meta, q.dtype, scale)
        self.kv_pool.set_kv(layer_id, meta.loc, k, v)
        k_buf, v_buf = self.kv_pool.get_kv(layer_id)
        paged = (k_buf.view(-1, 1, self.num_kv_heads, self.head_dim),
                 v_buf.view(-1, 1, self.num_kv_heads, self.head_dim))
        wrapper = self.decode_wrapper if meta.decode else self.prefill_wrapper
        # q arrives as a strided slice of the fused qkv projection; the kernels want it dense.
        return wrapper.run(q.contiguous(), paged)
