"""Which part of the model each tensor-parallel rank holds (pure arithmetic, no torch.distributed).

Attention is split by KV-head GROUPS: a rank holds some KV heads together with every query
head that reads them, so its attention needs nothing from another rank. The groups are
dealt out as evenly as they go and unevenly where they must: SmolLM2-135M has 9 query heads
over 3 KV heads, which no even split over 2 ranks allows (SGLang and vLLM refuse it); here
rank 0 gets 2 KV heads with their 6 query heads and rank 1 the third with its 3. With fewer
KV heads than ranks each KV head is replicated on the ranks that share its group, and the
group's query heads are split between them (as SGLang replicates KV heads). A split exists
whenever every rank can get at least one query head, so the only refusal is tp_size > heads.

The MLP's intermediate dimension and the vocabulary are cut into contiguous ranges that
differ by at most one row (1,536 and 49,152 split evenly over 2). Column-parallel weights
(q/k/v, gate/up, the embedding, the LM head) are cut along their output rows, row-parallel
ones (o_proj, down_proj) along their input columns; a row-parallel bias is added once, by
rank 0, after the all-reduce. A mixture-of-experts layer cuts every expert the same way (its
gate/up rows and down_proj columns over `moe_intermediate_size`); its router is replicated.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from radixlm.config import ModelConfig


@dataclass(frozen=True)
class Span:
    """[start, stop) of some dimension."""
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Shard:
    """The part of a full (Hugging Face) tensor a rank keeps: rows or columns [start, stop) of
    dimension `dim`, whose full length is `full`. An empty range (start == stop) means the
    rank keeps none of it (a row-parallel bias lives on rank 0 only)."""
    dim: int
    start: int
    stop: int
    full: int

    @property
    def held(self) -> bool:
        return self.stop > self.start


def even_spans(total: int, parts: int) -> list[Span]:
    """`total` cut into `parts` contiguous spans whose sizes differ by at most one (larger first)."""
    base, extra = divmod(total, parts)
    spans, start = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        spans.append(Span(start, start + size))
        start += size
    return spans


def split_attention(num_heads: int, num_kv_heads: int, tp_size: int) -> list[tuple[Span, Span]]:
    """(query heads, KV heads) of every rank. ValueError where no group split exists."""
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} attention heads do not form groups over {num_kv_heads} KV heads")
    if tp_size > num_heads:
        raise ValueError(f"tp_size {tp_size} is larger than the model's {num_heads} attention heads: "
                         f"a rank would hold no head (choose tp_size <= {num_heads})")
    group = num_heads // num_kv_heads
    if num_kv_heads >= tp_size:
        return [(Span(kv.start * group, kv.stop * group), kv) for kv in even_spans(num_kv_heads, tp_size)]
    out: list[tuple[Span, Span]] = []
    # Fewer KV heads than ranks: KV head j is replicated on its ranks, which split its group.
    # group >= ceil(tp / kv) because heads = group * kv >= tp, so each rank gets a query head.
    for kv, ranks in enumerate(even_spans(tp_size, num_kv_heads)):
        for q in even_spans(group, ranks.size):
            out.append((Span(kv * group + q.start, kv * group + q.stop), Span(kv, kv + 1)))
    return out


@dataclass(frozen=True)
class TPLayout:
    """What rank `tp_rank` of `tp_size` holds of a model with config `cfg`."""
    tp_size: int
    tp_rank: int
    head_dim: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    q_heads: Span
    kv_heads: Span
    intermediate: Span
    vocab: Span
    vocab_spans: tuple[Span, ...]  # every rank's vocabulary range (gathering the logits)
    # Mixture of experts: every expert's intermediate rows [start, stop) on this rank (the
    # router replicated), as the dense MLP's; its down_proj's output is all-reduced the same way.
    moe_intermediate_size: int = 0
    moe_intermediate: Span = Span(0, 0)

    @staticmethod
    def build(cfg: ModelConfig, tp_size: int, tp_rank: int) -> "TPLayout":
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank {tp_rank} is outside [0, {tp_size})")
        heads = split_attention(cfg.num_attention_heads, cfg.num_key_value_heads, tp_size)
        for what, total in (("intermediate size", cfg.intermediate_size), ("vocabulary", cfg.vocab_size)):
            if total < tp_size:
                raise ValueError(f"tp_size {tp_size} is larger than the model's {what} ({total})")
        vocab = even_spans(cfg.vocab_size, tp_size)
        q, kv = heads[tp_rank]
        moe = Span(0, 0)
        if cfg.num_experts > 0:
            if cfg.moe_intermediate_size < tp_size:
                raise ValueError(f"tp_size {tp_size} is larger than the model's expert intermediate size "
                                 f"({cfg.moe_intermediate_size})")
            moe = even_spans(cfg.moe_intermediate_size, tp_size)[tp_rank]
        return TPLayout(tp_size, tp_rank, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads,
                        cfg.intermediate_size, cfg.vocab_size, q, kv,
                        even_spans(cfg.intermediate_size, tp_size)[tp_rank], vocab[tp_rank], tuple(vocab),
                        cfg.moe_intermediate_size, moe)

    @staticmethod
    def single(cfg: ModelConfig) -> "TPLayout":
        return TPLayout.build(cfg, 1, 0)

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """The shapes this rank computes with (heads, intermediate size and vocabulary of its shard)."""
        import dataclasses
        return dataclasses.replace(cfg, num_attention_heads=self.q_heads.size,
                                   num_key_value_heads=self.kv_heads.size,
                                   intermediate_size=self.intermediate.size, vocab_size=self.vocab.size,
                                   moe_intermediate_size=self.moe_intermediate.size)

    def shard(self, name: str) -> Shard | None:
        """The part of Hugging Face tensor `name` this rank keeps; None: all of it (replicated)."""
        if self.tp_size == 1:
            return None
        d = self.head_dim
        prefix, _, leaf = name.rpartition(".")
        expert = _EXPERT_PROJ.search(prefix)
        if expert is not None:  # an expert's gate/up rows or down_proj columns (no biases)
            span = self.moe_intermediate
            return Shard(0 if expert.group(1) in _EXPERT_IN else 1, span.start, span.stop, self.moe_intermediate_size)
        q = Shard(0, self.q_heads.start * d, self.q_heads.stop * d, self.num_heads * d)
        kv = Shard(0, self.kv_heads.start * d, self.kv_heads.stop * d, self.num_kv_heads * d)
        inter = Shard(0, self.intermediate.start, self.intermediate.stop, self.intermediate_size)
        if prefix.endswith("self_attn.q_proj"):
            return q
        if prefix.endswith(("self_attn.k_proj", "self_attn.v_proj")):
            return kv
        if prefix.endswith(("mlp.gate_proj", "mlp.up_proj")):
            return inter
        if prefix.endswith(("self_attn.o_proj", "mlp.down_proj")):
            if leaf == "bias":  # added once after the all-reduce, by rank 0
                return None if self.tp_rank == 0 else Shard(0, 0, 0, 0)
            cols = q if prefix.endswith("o_proj") else inter
            return Shard(1, cols.start, cols.stop, cols.full)
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return Shard(0, self.vocab.start, self.vocab.stop, self.vocab_size)
        return None


# An expert's projections: Qwen3-MoE's gate_proj/up_proj/down_proj, Mixtral's w1 (gate), w3 (up), w2 (down).
_EXPERT_PROJ = re.compile(r"\.experts\.\d+\.(gate_proj|up_proj|down_proj|w1|w2|w3)$")
_EXPERT_IN = ("gate_proj", "up_proj", "w1", "w3")  # column-parallel (their output rows cut)
