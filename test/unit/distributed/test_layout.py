"""The tensor-parallel layout: KV-head groups dealt out unevenly where needed, KV heads
replicated when there are fewer than ranks, a clear refusal only where no split exists, and
the part of every Hugging Face tensor each rank keeps."""
from __future__ import annotations

import pytest

from radixlm.config import ModelConfig
from radixlm.srt.distributed.layout import Shard, Span, TPLayout, even_spans, split_attention

SMOLLM2 = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True)


def test_smollm2_at_tp2_splits_groups_2_plus_1():
    r0, r1 = (TPLayout.build(SMOLLM2, 2, r) for r in (0, 1))
    assert (r0.kv_heads, r0.q_heads) == (Span(0, 2), Span(0, 6))
    assert (r1.kv_heads, r1.q_heads) == (Span(2, 3), Span(6, 9))
    assert (r0.intermediate, r1.intermediate) == (Span(0, 768), Span(768, 1536))
    assert (r0.vocab, r1.vocab) == (Span(0, 24576), Span(24576, 49152))
    local = r1.local_config(SMOLLM2)
    assert (local.num_attention_heads, local.num_key_value_heads, local.intermediate_size,
            local.vocab_size) == (3, 1, 768, 24576)


def test_every_query_head_is_held_once_with_its_kv_head():
    for heads, kv in ((9, 3), (4, 1), (8, 2), (32, 8), (12, 4), (6, 6)):
        for tp in range(1, heads + 1):
            split = split_attention(heads, kv, tp)
            assert len(split) == tp
            held = [h for q, _ in split for h in range(q.start, q.stop)]
            assert held == list(range(heads)), (heads, kv, tp)
            group = heads // kv
            for q, kvs in split:
                assert q.size >= 1 and kvs.size >= 1
                # every query head's KV head is on the same rank
                assert all(kvs.start <= h // group < kvs.stop for h in range(q.start, q.stop))


def test_fewer_kv_heads_than_ranks_replicates_them():
    split = split_attention(9, 3, 4)  # 4 ranks over 3 KV heads: head 0 on two ranks
    assert split == [(Span(0, 2), Span(0, 1)), (Span(2, 3), Span(0, 1)), (Span(3, 6), Span(1, 2)),
                     (Span(6, 9), Span(2, 3))]
    assert [kv for _, kv in split_attention(4, 1, 2)] == [Span(0, 1), Span(0, 1)]


def test_no_split_is_a_clear_error():
    with pytest.raises(ValueError, match="tp_size 10 is larger than the model's 9 attention heads"):
        TPLayout.build(SMOLLM2, 10, 0)
    with pytest.raises(ValueError, match="outside"):
        TPLayout.build(SMOLLM2, 2, 2)


def test_even_spans():
    assert even_spans(7, 3) == [Span(0, 3), Span(3, 5), Span(5, 7)]
    assert even_spans(4, 4) == [Span(i, i + 1) for i in range(4)]


def test_hf_tensor_shards():
    r1 = TPLayout.build(SMOLLM2, 2, 1)
    layer = "model.layers.3."
    assert r1.shard(layer + "self_attn.q_proj.weight") == Shard(0, 384, 576, 576)
    assert r1.shard(layer + "self_attn.k_proj.weight") == Shard(0, 128, 192, 192)
    assert r1.shard(layer + "self_attn.v_proj.bias") == Shard(0, 128, 192, 192)
    assert r1.shard(layer + "self_attn.o_proj.weight") == Shard(1, 384, 576, 576)
    assert r1.shard(layer + "mlp.up_proj.weight") == Shard(0, 768, 1536, 1536)
    assert r1.shard(layer + "mlp.down_proj.weight") == Shard(1, 768, 1536, 1536)
    assert r1.shard("model.embed_tokens.weight") == Shard(0, 24576, 49152, 49152)
    assert r1.shard(layer + "input_layernorm.weight") is None  # replicated
    assert not r1.shard(layer + "self_attn.o_proj.bias").held  # rank 0 adds it once
    assert TPLayout.build(SMOLLM2, 2, 0).shard(layer + "self_attn.o_proj.bias") is None
    assert TPLayout.single(SMOLLM2).shard(layer + "self_attn.q_proj.weight") is None
