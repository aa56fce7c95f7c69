"""Gemma 2 and Gemma 3 (text) decoders over a flat token batch.

What differs from Llama (llama.py, whose weight loading, quantization, tensor parallelism and
LM head these classes reuse):
- embeddings multiplied by sqrt(hidden_size) (rounded to the model dtype, as Hugging Face does);
- every norm is GemmaRMSNorm, scale (1 + w) in float32; each layer norms the attention output
  (post_attention_layernorm) and brackets its MLP with pre/post feed-forward norms;
- the MLP is gated GELU-tanh; attention is scaled by query_pre_attn_scalar ** -0.5;
- Gemma 3 RMS-normalises each query and key head (q_norm, k_norm) before rope;
- layers are sliding ("sliding_attention": a query at position p sees keys p - window < j <= p)
  or global, each kind with its own rope (Gemma 3: rope_local_base_freq for the sliding ones,
  rope_theta and rope_scaling for the global ones; Gemma 2: one rope);
- Gemma 2 soft-caps attention scores and final logits (cap * tanh(x / cap)).
The attention backend does the window and the score cap (`window=`, `softcap=`); see
docs/semantics.md for what the out-of-window KV of the sliding layers costs.

The native fused layers (fused_decode.py) are Llama's graph and are never used here.
"""
from __future__ import annotations

import torch
from torch import nn

from radixlm.config import ModelConfig
from radixlm.srt.distributed import vocab_parallel
from radixlm.srt.distributed.context import TPContext
from radixlm.srt.layers.activation import GatedMLP
from radixlm.srt.layers.linear import Embedding, Linear
from radixlm.srt.layers.norm import GemmaRMSNorm
from radixlm.srt.layers.rotary import BatchRope, RotaryEmbedding
from radixlm.srt.model_runner.attention.base import AttentionBackend
from radixlm.srt.model_runner.forward_batch import ForwardBatch
from radixlm.srt.models.llama import LlamaForCausalLM

SLIDING = "sliding_attention"


class GemmaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, dtype: torch.dtype, tp: TPContext,
                 qk_norm: bool) -> None:
        """`config` holds this rank's shapes (TPLayout.local_config)."""
        super().__init__()
        self.layer_id = layer_id
        self.tp = tp.comm
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = d = config.head_dim
        self.q_size = self.num_heads * d
        self.kv_size = self.num_kv_heads * d
        self.scale = (config.query_pre_attn_scalar or d) ** -0.5
        self.window = config.layer_window(layer_id)
        self.softcap = config.attn_logit_softcapping
        bias = config.attention_bias
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias, dtype=dtype)
        # Row-parallel: rank 0 alone adds the bias (once, to the sum).
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=bias and tp.rank == 0, dtype=dtype)
        self.q_norm = GemmaRMSNorm(d, config.rms_norm_eps, dtype) if qk_norm else None
        self.k_norm = GemmaRMSNorm(d, config.rms_norm_eps, dtype) if qk_norm else None

    def forward(self, x: torch.Tensor, rope: BatchRope, fb: ForwardBatch, attn: AttentionBackend,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        t, h, hkv, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj.forward(x).view(t, h + 2 * hkv, d)
        v = qkv[:, h + hkv:]
        if self.q_norm is None or self.k_norm is None:
            qk = rope.apply(qkv[:, :h + hkv])
        else:  # each head normalised over head_dim, then rotated
            qk = torch.cat((self.q_norm.forward(qkv[:, :h].reshape(t * h, d)).view(t, h, d),
                            self.k_norm.forward(qkv[:, h:h + hkv].reshape(t * hkv, d)).view(t, hkv, d)), dim=1)
            qk = rope.apply(qk)
        q, k = qk[:, :h], qk[:, h:]
        if rows is None:
            o = attn.forward(q, k, v, self.layer_id, fb, self.scale, window=self.window, softcap=self.softcap)
        else:
            o = attn.forward_rows(q, k, v, self.layer_id, fb, self.scale, rows, window=self.window,
                                  softcap=self.softcap)
            if o.shape[0] == 0:  # a chunk that samples nothing: its K/V stored, nothing else to do
                return x[:0]
        return self.tp.all_reduce(self.o_proj.forward(o.reshape(o.shape[0], self.q_size)))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, dtype: torch.dtype, tp: TPContext,
                 qk_norm: bool) -> None:
        super().__init__()
        self.tp = tp.comm
        self.sliding = config.layer_window(layer_id) is not None
        eps, hidden = config.rms_norm_eps, config.hidden_size
        self.input_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.self_attn = GemmaAttention(config, layer_id, dtype, tp, qk_norm)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.mlp = GatedMLP(hidden, config.intermediate_size, dtype, activation=config.hidden_activation)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, rope: BatchRope, fb: ForwardBatch,
                attn: AttentionBackend, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) in, (post-feed-forward-normed MLP output, residual) out: each residual
        add is fused into the norm after it, as in llama.py."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm.forward(hidden)
        else:
            hidden, residual = self.input_layernorm.forward(hidden, residual)
        hidden = self.self_attn.forward(hidden, rope, fb, attn, rows)
        if rows is not None:
            residual = residual.index_select(0, rows)
            if rows.numel() == 0:
                return hidden, residual
        hidden = self.post_attention_layernorm.forward(hidden)
        hidden, residual = self.pre_feedforward_layernorm.forward(hidden, residual)
        hidden = self.tp.all_reduce(self.mlp.forward(hidden))  # down_proj is row-parallel
        return self.post_feedforward_layernorm.forward(hidden), residual


class GemmaModel(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, tp: TPContext, qk_norm: bool) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype)
        self.layers = nn.ModuleList(GemmaDecoderLayer(config, i, dtype, tp, qk_norm)
                                    for i in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype)


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3's text model; Gemma2ForCausalLM below differs by its q/k norms (none) and rope."""

    qk_norm = True

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32, tp: TPContext | None = None) -> None:
        nn.Module.__init__(self)
        if config.layer_types and len(config.layer_types) != config.num_hidden_layers:
            raise ValueError(f"{len(config.layer_types)} layer_types for {config.num_hidden_layers} layers")
        self.config = config
        self.tp = tp or TPContext.single(config)
        self.local_config = local = self.tp.layout.local_config(config)
        self.dtype = dtype
        self.model = GemmaModel(local, dtype, self.tp, self.qk_norm)
        self.rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta,
                                      config.rope_scaling)
        # The sliding layers' rope (Gemma 3: its own base, never scaled); None: the global one.
        self.local_rotary = None
        if config.rope_local_base_freq is not None and SLIDING in config.layer_types:
            self.local_rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                                config.rope_local_base_freq)
        self.lm_head = None if config.tie_word_embeddings else Linear(config.hidden_size, local.vocab_size,
                                                                      dtype=dtype)
        self._tied_head_packed = None
        self._tied_head_pack_tried = False
        self.quantization = None
        self._tied_head_int8 = None
        self._fused_decode = None  # Llama's fused layers do not apply (module docstring)
        # sqrt(hidden) rounded to the model dtype first, as Hugging Face multiplies it.
        self._embed_scale = torch.tensor(config.hidden_size ** 0.5, dtype=dtype, device="cpu").item()

    def forward(self, fb: ForwardBatch, attn: AttentionBackend, rows: torch.Tensor | None = None) -> torch.Tensor:
        """As LlamaForCausalLM.forward: final-normed hidden states of every token, or of `rows`."""
        hidden = vocab_parallel.embed(fb.input_ids, self.model.embed_tokens.weight, self.tp.layout.vocab, self.tp.comm)
        hidden = hidden * self._embed_scale
        max_len = max(fb.seq_lens_cpu) if fb.seq_lens_cpu else None
        global_rope = BatchRope.build(self.rotary, fb.positions, hidden.dtype, max_len)
        local_rope = global_rope if self.local_rotary is None else \
            BatchRope.build(self.local_rotary, fb.positions, hidden.dtype, max_len)
        residual: torch.Tensor | None = None
        last = len(self.model.layers) - 1
        for i, layer in enumerate(self.model.layers):
            rope = local_rope if layer.sliding else global_rope
            hidden, residual = layer.forward(hidden, residual, rope, fb, attn, rows if i == last else None)
        if residual is None:  # zero layers
            hidden = self.model.norm.forward(hidden)
            return hidden if rows is None else hidden.index_select(0, rows)
        hidden, _ = self.model.norm.forward(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def greedy_tokens(self, hidden: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        # tanh can round two large logits to one value (a tie the capped argmax resolves by
        # index): the capped logits decide, so compute them.
        if self.config.final_logit_softcapping is not None:
            return None
        return super().greedy_tokens(hidden, vocab_size)


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    """Gemma 2: no q/k norms, one rope for every layer, soft-capped scores and logits (config)."""

    qk_norm = False


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """The text model of a Gemma 3 image-text checkpoint: the vision tower and projector are
    skipped, the language model's weights renamed to Gemma3ForCausalLM's."""

    _PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                 ("language_model.lm_head.", "lm_head."))
    _SKIPPED = ("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.", "multi_modal_projector.")

    def _param_target(self, name: str) -> tuple[str, int, int] | None:
        if name.startswith(self._SKIPPED):
            return None
        for old, new in self._PREFIXES:
            if name.startswith(old):
                name = new + name[len(old):]
                break
        return super()._param_target(name)
