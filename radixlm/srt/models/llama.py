"""Llama-family decoder (Llama, Mistral, Qwen2) over a flat token batch.

Inference only. q/k/v and gate/up are fused into single matrices for fewer, larger
GEMMs; load_weights maps the Hugging Face names (q_proj, k_proj, ...) onto row ranges
of the fused matrices.

Under tensor parallelism (srt/distributed/) a model holds one rank's shard: its KV-head
groups, its part of the MLP and of the vocabulary (`TPContext.layout`); o_proj and
down_proj are row-parallel, their outputs all-reduced; the embedding and the LM head are
vocabulary-parallel. Weights arrive already cut to the shard (the loader reads only the
shard; `hf_shard` says which part of each Hugging Face tensor that is).
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from radixlm.config import ModelConfig
from radixlm.srt.distributed import vocab_parallel
from radixlm.srt.distributed.context import TPContext
from radixlm.srt.distributed.layout import Shard
from radixlm.srt.layers import bf16_gemm
from radixlm.srt.layers.activation import GatedMLP
from radixlm.srt.layers.int8_linear import Int8Weight, int8_linear, quantize_weight
from radixlm.srt.layers.linear import Embedding, Linear, Packed, linear_packed, pack_for
from radixlm.srt.layers.norm import RMSNorm
from radixlm.srt.layers.rotary import BatchRope, RotaryEmbedding
from radixlm.srt.model_runner.attention.base import AttentionBackend
from radixlm.srt.model_runner.forward_batch import ForwardBatch
from radixlm.srt.models.fused_decode import FusedDecode


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, dtype: torch.dtype, tp: TPContext) -> None:
        """`config` holds this rank's shapes (TPLayout.local_config)."""
        super().__init__()
        self.layer_id = layer_id
        self.tp = tp.comm
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        qkv_bias = config.attention_bias
        # HF Llama's attention_bias also puts a bias on o_proj; Qwen2 has q/k/v biases only.
        # Row-parallel: rank 0 alone adds the bias (once, to the sum).
        o_bias = config.attention_bias and config.architecture != "Qwen2ForCausalLM" and tp.rank == 0
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias, dtype=dtype)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=o_bias, dtype=dtype)

    def forward(self, x: torch.Tensor, rope: BatchRope, fb: ForwardBatch, attn: AttentionBackend,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """Every token's K/V is stored; the output is only for `rows` when given."""
        t = x.shape[0]
        qkv = self.qkv_proj.forward(x).view(t, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        # Rotate q and k together: they are adjacent head ranges of the fused output.
        qk = rope.apply(self.before_rope(qkv[:, :self.num_heads + self.num_kv_heads]))
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        v = qkv[:, self.num_heads + self.num_kv_heads:]
        if rows is None:
            o = attn.forward(q, k, v, self.layer_id, fb, self.scale)
        else:
            o = attn.forward_rows(q, k, v, self.layer_id, fb, self.scale, rows)
            if o.shape[0] == 0:  # a chunk that samples nothing: its K/V stored, nothing else to do
                return x[:0]
        return self.tp.all_reduce(self.o_proj.forward(o.reshape(o.shape[0], self.q_size)))

    def before_rope(self, qk: torch.Tensor) -> torch.Tensor:
        """[T, heads + kv_heads, head_dim] q and k as they enter RoPE (Qwen3 normalises them here)."""
        return qk


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, dtype: torch.dtype, tp: TPContext) -> None:
        super().__init__()
        self.tp = tp.comm
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = self.make_attention(config, layer_id, dtype, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = self.make_mlp(config, layer_id, dtype)

    # Where a family's layer differs (Qwen3's q/k norms, a sparse MoE block), its subclass says so.
    def make_attention(self, config: ModelConfig, layer_id: int, dtype: torch.dtype, tp: TPContext) -> LlamaAttention:
        return LlamaAttention(config, layer_id, dtype, tp)

    def make_mlp(self, config: ModelConfig, layer_id: int, dtype: torch.dtype) -> nn.Module:
        return GatedMLP(config.hidden_size, config.intermediate_size, dtype)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, rope: BatchRope,
                fb: ForwardBatch, attn: AttentionBackend,
                rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`rows`: the only tokens whose outputs are needed (the last layer's caller knows them)."""
        # Pre-norm residual block; the residual add is fused into the next norm. Submodules
        # are called through .forward: nn.Module.__call__'s hook handling costs ~3 us per
        # call, ~10 calls per layer per step, and no hooks are ever registered here.
        if residual is None:
            residual, hidden = hidden, self.input_layernorm.forward(hidden)
        else:
            hidden, residual = self.input_layernorm.forward(hidden, residual)
        hidden = self.self_attn.forward(hidden, rope, fb, attn, rows)
        if rows is not None:
            residual = residual.index_select(0, rows)
            if rows.numel() == 0:
                return hidden, residual
        hidden, residual = self.post_attention_layernorm.forward(hidden, residual)
        return self.tp.all_reduce(self.mlp.forward(hidden)), residual  # down_proj is row-parallel


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, tp: TPContext,
                 layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype)
        self.layers = nn.ModuleList(layer_cls(config, i, dtype, tp) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)


class LlamaForCausalLM(nn.Module):
    layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer
    # The native layer loop (fused_decode.py) computes exactly LlamaDecoderLayer; a family whose
    # layers do more (q/k norms, MoE) says False and runs its Python layers.

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32, tp: TPContext | None = None) -> None:
        super().__init__()
        self.config = config
        self.tp = tp or TPContext.single(config)
        # This rank's shapes: its heads, MLP rows and vocabulary rows (all of them on one rank).
        self.local_config = local = self.tp.layout.local_config(config)
        self.dtype = dtype
        self.model = LlamaModel(local, dtype, self.tp, self.layer_cls)
        self.rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta,
                                      config.rope_scaling, config.rotary_dim)
        if config.tie_word_embeddings:
            self.lm_head = None  # logits reuse embed_tokens.weight
        else:
            self.lm_head = Linear(config.hidden_size, local.vocab_size, dtype=dtype)
        # Prepacked (oneDNN) copy of a tied LM head; see layers/linear.py. Untied heads are a
        # Linear and pack themselves.
        self._tied_head_packed: Packed | None = None
        self._tied_head_pack_tried = False  # pack_for is None on CPUs where F.linear is best
        self.quantization: str | None = None
        self._tied_head_int8: Int8Weight | None = None
        self._fused_decode = FusedDecode(self)

    def set_quantization(self, method: str | None) -> None:
        """Multiply every Linear (LM head included) through int8 copies of the weights
        (method "w8a8_int8", see layers/int8_linear.py) or, with None, the float weights."""
        self.quantization = method
        self._tied_head_int8 = None
        for module in self.modules():
            if isinstance(module, Linear):
                module.quantization = method
                module.invalidate_packed()
        self.prepare_quantized()

    def prepare_quantized(self) -> None:
        """Build every missing int8 copy now (~0.7 s for 135M parameters) rather than in the
        first forward after start-up or after a weight update, where it would land on a
        request's latency."""
        if self.quantization is None:
            return
        for module in self.modules():
            if isinstance(module, Linear) and module.quantization is not None:  # a MoE router stays float
                module.int8_weight()
        if self.lm_head is None:
            self._tied_head_int8_weight()

    def _tied_head_int8_weight(self) -> Int8Weight:
        """The int8 copy of a tied LM head (the embedding), built if missing."""
        if self._tied_head_int8 is None:
            self._tied_head_int8 = quantize_weight(self.model.embed_tokens.weight)
        return self._tied_head_int8

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, fb: ForwardBatch, attn: AttentionBackend, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Final-normed hidden states [T, hidden] of every token in the flat batch, or with
        `rows` (int64 token indices) [len(rows), hidden] of those tokens only.

        Only the rows that become logits leave the model, so the last layer attends
        (`forward_rows`), projects, runs its MLP and the final norm for those rows alone (a
        prefill chunk of 1,024 tokens needs one): ~1/num_layers of a long prefill. Every
        layer, the last included, still stores every token's K/V."""
        hidden = vocab_parallel.embed(fb.input_ids, self.model.embed_tokens.weight, self.tp.layout.vocab, self.tp.comm)
        max_len = max(fb.seq_lens_cpu) if fb.seq_lens_cpu else None
        # Rope tables for this batch's positions, built once and shared by all layers.
        rope = BatchRope.build(self.rotary, fb.positions, hidden.dtype, max_len)
        fused = self._fused_decode.forward(fb, attn, hidden, rope, rows)  # None: not a step it takes
        if fused is not None:
            return fused
        residual: torch.Tensor | None = None
        last = len(self.model.layers) - 1
        for i, layer in enumerate(self.model.layers):
            hidden, residual = layer.forward(hidden, residual, rope, fb, attn, rows if i == last else None)
        if residual is None:  # zero layers
            hidden = self.model.norm.forward(hidden)
            return hidden if rows is None else hidden.index_select(0, rows)
        hidden, _ = self.model.norm.forward(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> float32 [n, vocab] (the whole vocabulary on every rank)."""
        return vocab_parallel.gather_logits(self._shard_logits(hidden), self.tp.layout.vocab_spans, self.tp.comm)

    def greedy_tokens(self, hidden: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """compute_logits(hidden)[:, :vocab_size].argmax(-1), the same ids, without the logits
        (int64 [n]), where the LM head allows it: one rank, the tied head multiplied in int8
        or through radixlm's bf16 GEMM (whose logits, 32 x 49,152 float32 in a decode step, are
        then never written). None elsewhere: the caller computes the logits."""
        if self.tp.size > 1 or self.lm_head is not None or hidden.dim() != 2 or hidden.stride(1) != 1:
            return None
        if self.quantization is not None:
            gemm = self._tied_head_int8_weight().gemm
            if gemm is None or hidden.dtype not in (torch.float32, torch.bfloat16):
                return None
            return gemm.argmax(hidden, vocab_size)
        packed = self._tied_head_pack()
        if isinstance(packed, bf16_gemm.PackedBf16Weight):
            return bf16_gemm.argmax(hidden, packed, vocab_size)  # the logits' bf16 rounding included
        return None

    def _tied_head_pack(self) -> Packed | None:
        if not self._tied_head_pack_tried:
            self._tied_head_packed = pack_for(self.model.embed_tokens.weight)
            self._tied_head_pack_tried = True
        return self._tied_head_packed

    def _shard_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is not None:
            return self.lm_head.forward(hidden).float()
        weight = self.model.embed_tokens.weight
        if self.quantization is not None:
            return int8_linear(hidden, self._tied_head_int8_weight(), None, torch.float32)
        return linear_packed(hidden, weight, self._tied_head_pack(), None).float()

    def _invalidate_packed(self, pname: str) -> None:
        """Drop the prepacked copy of a weight that the caller is about to write."""
        if pname == "model.embed_tokens.weight":
            self._tied_head_packed = None
            self._tied_head_pack_tried = False
            self._tied_head_int8 = None
        owner = pname.rpartition(".")[0]
        try:
            module = self.get_submodule(owner)
        except AttributeError:
            return
        if isinstance(module, Linear):
            module.invalidate_packed()

    # ---- weights ----
    def hf_shard(self, name: str) -> Shard | None:
        """The part of the full Hugging Face tensor `name` this rank holds (None: all of it)."""
        return self.tp.layout.shard(name)

    def _param_target(self, name: str) -> tuple[str, int, int] | None:
        """HF name (of this rank's shard) -> (our parameter name, row offset, row count); None =
        ignore the tensor."""
        cfg = self.local_config
        if name.endswith("rotary_emb.inv_freq"):
            return None  # old checkpoints store the (recomputed) rope table
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            return None  # tied checkpoints may still carry a copy of the embedding
        q, kv, inter = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim, \
            cfg.intermediate_size
        fused = {
            "self_attn.q_proj": ("self_attn.qkv_proj", 0, q),
            "self_attn.k_proj": ("self_attn.qkv_proj", q, kv),
            "self_attn.v_proj": ("self_attn.qkv_proj", q + kv, kv),
            "mlp.gate_proj": ("mlp.gate_up_proj", 0, inter),
            "mlp.up_proj": ("mlp.gate_up_proj", inter, inter),
        }
        prefix, _, leaf = name.rpartition(".")  # leaf: weight | bias
        # Every caller that resolves a name (loader, RL weight updater) may write the
        # parameter next: drop its packed copy so the next forward repacks fresh values.
        for src, (dst, off, rows) in fused.items():
            if prefix.endswith("." + src):
                pname = f"{prefix[:-len(src)]}{dst}.{leaf}"
                self._invalidate_packed(pname)
                return pname, off, rows
        self._invalidate_packed(name)
        return name, 0, -1

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        # Rows still missing per parameter: a fused matrix is complete only when all of
        # its parts arrived.
        missing: dict[str, set[tuple[int, int]]] = {n: {(0, p.shape[0])} for n, p in params.items()}
        for name, tensor in weights:
            target = self._param_target(name)
            if target is None:
                continue
            pname, off, rows = target
            param = params.get(pname)
            if param is None:
                raise ValueError(f"unexpected weight {name!r} for {self.config.architecture} "
                                 f"(no parameter {pname!r})")
            dest = param.data if rows < 0 else param.data.narrow(0, off, rows)
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ValueError(f"shape mismatch for {name!r}: checkpoint {tuple(tensor.shape)}, "
                                 f"model expects {tuple(dest.shape)}")
            dest.copy_(tensor)  # casts to the model dtype/device
            span = (0, param.shape[0]) if rows < 0 else (off, off + rows)
            missing[pname] = _subtract(missing[pname], span)
        unloaded = sorted(n for n, spans in missing.items() if spans)
        if unloaded:
            raise ValueError(f"weights missing from the checkpoint: {', '.join(unloaded[:8])}"
                             f"{' ...' if len(unloaded) > 8 else ''}")


def _subtract(spans: set[tuple[int, int]], cut: tuple[int, int]) -> set[tuple[int, int]]:
    out: set[tuple[int, int]] = set()
    for a, b in spans:
        if cut[1] <= a or cut[0] >= b:
            out.add((a, b))
            continue
        if a < cut[0]:
            out.add((a, cut[0]))
        if cut[1] < b:
            out.add((cut[1], b))
    return out


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Same graph; ModelConfig.attention_bias (always True for Qwen2) adds q/k/v biases."""


class MistralForCausalLM(LlamaForCausalLM):
    """Same graph as Llama (sliding-window attention is not implemented: full attention)."""
