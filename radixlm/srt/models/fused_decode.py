"""The decoder layers of a forward as one native call (kernels/cpu/decode_layers.cpp) where its
attention is decode-style rows (a decode step, or a batch of short extends: every new token one
row over its causal keys) or the prefill kernel (long extends), the last layer then only for the
rows that become logits, as the Python layers do it.

The Python layers (llama.py) call ~12 native kernels per layer, each behind 5-11 us of Python;
over 30 layers that was ~4 ms of a 9 ms batch-1 decode step of the default model in w8a8.
`FusedDecode` hands the same kernels, in the same order and with the same arguments, to one C
function, so its output and KV writes are bit for bit the Python layers' (tested against them:
test/unit/srt/test_fused_decode.py). It runs only where that holds; anything else returns None
and the model takes its Python layers:
- CPU, one rank (no all-reduce between the halves), float32 or bfloat16;
- every linear through a native kernel that takes its weight as the Python layer would: int8
  (w8a8_int8), radixlm's bf16 panels or its float panels (not oneDNN's prepacked copy, not
  F.linear), a bias of the model dtype;
- the attention backend's decode kernel (`CpuNativeAttention.decode_rows`) or its prefill
  kernel (`extend_rows`; with rows, those `forward_rows` gives it),
  native RoPE tables over whole heads, one norm epsilon for all norms;
- a model class listed in FUSED_GRAPH_CLASSES (its graph is the one the native layers run).
On a 2k prompt the Python between the kernels was ~3-6% of the prefill.
The pointer table is rebuilt when a Linear drops its packed copies (a weight update, a change of
quantization: `Linear.generation`) or the KV pool's buffers change (release / allocate).
RADIXLM_FUSED_DECODE=0 turns it off.
"""
from __future__ import annotations

import operator

import torch

import radixlm.envs as envs
from radixlm.kernels.cpu import decode_layers as native
from radixlm.kernels.cpu import ops as cpu_ops
from radixlm.srt.layers import bf16_gemm, float_gemm
from radixlm.srt.layers.gate_up_order import silu_gated_order
from radixlm.srt.layers.int8_linear import TILE_COLS
from radixlm.srt.layers.linear import Linear
from radixlm.srt.layers.rotary import BatchRope
from radixlm.srt.model_runner.attention.cpu import CpuNativeAttention
from radixlm.srt.model_runner.forward_batch import ForwardBatch

_DTYPES = (torch.float32, torch.bfloat16)
# The model classes whose forward is exactly the graph the native layers compute (pre-norm
# Llama blocks: fused qkv with optional bias, neox rope over the whole head, SiLU-gated MLP,
# one final norm). Matched by the class itself, not inherited: a new family that subclasses
# LlamaForCausalLM and changes the graph (q/k norms, other norms or activations, windows)
# takes its Python layers until it is added here.
FUSED_GRAPH_CLASSES = frozenset({"LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", "Phi3ForCausalLM"})


def _linear_spec(lin: Linear, dtype: torch.dtype) -> native.LinearSpec | None:
    bias = lin.bias
    if bias is not None and (bias.dtype != dtype or not bias.is_contiguous()):
        return None
    if lin.quantization is not None:
        w = lin.int8_weight()
        if w.gemm is None or w.packed is None:
            return None
        if w.silu_gated:
            bias = silu_gated_order(bias, TILE_COLS) if bias is not None else None
            return native.LinearSpec(native.INT8_SILU, w.out_features, w.in_features, w.packed, w.comp, w.scale,
                                     bias)
        return native.LinearSpec(native.INT8, w.out_features, w.in_features, w.packed, w.comp, w.scale, bias)
    packed = lin.packed_weight()
    if isinstance(packed, bf16_gemm.PackedBf16Weight) and dtype == torch.bfloat16:
        if packed.silu_gated:
            bias = silu_gated_order(bias, bf16_gemm.PANEL) if bias is not None else None
            return native.LinearSpec(native.BF16_PANELS_SILU, packed.out_features, packed.in_features,
                                     packed.panels, bias=bias)
        return native.LinearSpec(native.BF16_PANELS, packed.out_features, packed.in_features, packed.panels,
                                 bias=bias)
    if isinstance(packed, float_gemm.PackedFloatWeight) and packed.panels.dtype in _DTYPES:
        return native.LinearSpec(native.FLOAT_PANELS, packed.out_features, packed.in_features, packed.panels,
                                 bias=bias)
    return None


def _pool_buffers(pool) -> tuple[list, ...]:
    return pool.k_buffer, pool.v_buffer, pool.k_scale, pool.v_scale


class FusedDecode:
    """Per model: the native layer table, built on the first eligible decode step."""

    def __init__(self, model) -> None:
        self.model = model
        self._table: native.DecodeLayers | None = None
        self._generation = -1
        self._pool = None
        self._pool_snapshot: tuple[tuple, ...] = ()
        self._ineligible_generation: int | None = None  # static check failed at this generation

    def forward(self, fb: ForwardBatch, attn, hidden: torch.Tensor, rope: BatchRope,
                rows: torch.Tensor | None = None) -> torch.Tensor | None:
        """The final-normed hidden states of every token of the batch (of `rows` only, when
        given, as LlamaForCausalLM.forward), or None (the caller runs its Python layers).
        `hidden` holds the embeddings and is used as the residual stream, as there."""
        if not isinstance(attn, CpuNativeAttention):
            return None
        if not envs.fused_decode_enabled() or self._ineligible_generation == Linear.generation:
            return None
        decode = attn.decode_rows(fb)
        extend = attn.extend_rows(fb) if decode is None else None
        if (decode is None and extend is None) or not self._step_ok(fb, hidden, rope):
            return None
        spec = None
        if extend is not None:
            q_indptr, kv_indptr, kv_indices = extend
            # The last layer for `rows` alone, as forward_rows does it; rows it would take
            # elsewhere (not each request's last tokens) leave the forward to the Python layers.
            rows_indptr = None
            if rows is not None:
                rows_indptr = attn.rows_indptr(fb, rows)
                if rows_indptr is None or rows.dtype != torch.int64 or not rows.is_contiguous():
                    return None
            spec = native.ExtendRows(q_indptr, cpu_ops.EXTEND_PACK_BUDGET, rows, rows_indptr)
        table = self._current_table(attn)
        if table is None:
            return None
        if spec is not None:
            return table.run(hidden, rope.positions, rope.cos, rope.sin, fb.out_cache_loc, kv_indptr, kv_indices,
                             spec)
        out = table.run(hidden, rope.positions, rope.cos, rope.sin, fb.out_cache_loc, *decode)
        return out if rows is None else out.index_select(0, rows)

    def _step_ok(self, fb: ForwardBatch, hidden: torch.Tensor, rope: BatchRope) -> bool:
        loc, pos = fb.out_cache_loc, rope.positions
        return (rope.native and hidden.dtype == self.model.dtype and hidden.dim() == 2 and hidden.is_contiguous()
                and hidden.device.type == "cpu" and pos.dtype == torch.int64 and pos.is_contiguous()
                and rope.cos.dtype == torch.float32 and rope.cos.is_contiguous() and rope.sin.is_contiguous()
                and loc.dtype == torch.int64 and loc.is_contiguous())

    def _current_table(self, attn: CpuNativeAttention) -> native.DecodeLayers | None:
        pool = attn.kv_pool
        if (self._table is not None and self._generation == Linear.generation and self._pool is pool
                and all(all(map(operator.is_, now, then))
                        for now, then in zip(_pool_buffers(pool), self._pool_snapshot))):
            return self._table
        self._table = None
        generation = Linear.generation  # before building: building may pack (which does not bump it)
        table = self._build(attn)
        if table is None:
            self._ineligible_generation = generation
            return None
        self._table, self._generation, self._pool = table, generation, pool
        self._pool_snapshot = tuple(tuple(b) for b in _pool_buffers(pool))
        return table

    def _build(self, attn: CpuNativeAttention) -> native.DecodeLayers | None:
        model, dtype = self.model, self.model.dtype
        cfg = model.config
        # Llama's graph only: no sliding windows, soft caps, GELU MLPs or other attention scales.
        if (cfg.layer_types or cfg.attn_logit_softcapping is not None or cfg.final_logit_softcapping is not None
                or cfg.hidden_activation != "silu" or cfg.query_pre_attn_scalar is not None):
            return None
        if model.tp.size != 1 or dtype not in _DTYPES or not cpu_ops.available() or not attn.native_decode:
            return None
        if type(model).__name__ not in FUSED_GRAPH_CLASSES or model.rotary.rotary_dim != model.config.head_dim:
            return None  # the kernel rotates whole heads of the Llama graph only
        layers = list(model.model.layers)
        norms = [model.model.norm] + [n for layer in layers
                                      for n in (layer.input_layernorm, layer.post_attention_layernorm)]
        if any(n.weight.dtype != dtype or not n.weight.is_contiguous() or n.eps != norms[0].eps for n in norms):
            return None
        pool = attn.kv_pool
        specs = []
        for i, layer in enumerate(layers):
            sa, mlp = layer.self_attn, layer.mlp
            lins = [_linear_spec(m, dtype) for m in (sa.qkv_proj, sa.o_proj, mlp.gate_up_proj, mlp.down_proj)]
            if any(s is None for s in lins):
                return None
            k_buf, v_buf = pool.get_kv(i)
            k_scale = v_scale = None
            if attn.quantized:
                k_scale, v_scale = pool.k_scale[i], pool.v_scale[i]
                if k_buf.dtype != torch.int8 or k_scale.dtype != torch.float32:
                    return None
            elif k_buf.dtype != dtype:
                return None
            bufs = [t for t in (k_buf, v_buf, k_scale, v_scale) if t is not None]
            if not all(t.is_contiguous() for t in bufs):
                return None
            specs.append(native.LayerSpec(layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                                          *lins, k_buf, v_buf, k_scale, v_scale))
        if not layers:
            return None
        sa0 = layers[0].self_attn
        return native.DecodeLayers(specs, model.model.norm.weight, model.local_config.hidden_size,
                                   sa0.num_heads, sa0.num_kv_heads, sa0.head_dim, layers[0].mlp.intermediate_size,
                                   norms[0].eps, sa0.scale)
