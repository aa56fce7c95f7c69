"""Decoder layers as one native call (models/fused_decode.py: decode steps, short extends, and
long extends on the prefill kernel, the last layer then for the logits rows alone)
against the Python layers it replaces: the same hidden states and the same KV writes, bit for
bit, in every dtype, quantization and KV cache dtype it takes; rebuilt after a weight update and
after the KV pool is released and allocated again; declined where the Python layers do something
else (a long extend on SDPA, rows forward_rows takes through torch)."""
from __future__ import annotations

import pytest
import torch

from radixlm.kernels.cpu import decode_layers as native
from radixlm.kernels.cpu import ops as cpu_ops
from radixlm.srt.layers.linear import Linear
from radixlm.srt.model_runner.attention.base import create_attention_backend
from radixlm.srt.model_runner.forward_batch import ForwardBatch, ForwardMode
from radixlm.srt.model_runner.kv_pool import MHATokenToKVPool
from radixlm.srt.model_runner.weight_updater import WeightUpdater
from radixlm.srt.models import fused_decode
from radixlm.srt.models.registry import build_model
from radixlm.srt.weights.loader import iter_weights, load_model_config

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="native CPU kernels could not be built")


@pytest.fixture(scope="module")
def head64_llama_dir(tmp_path_factory, smollm2_tokenizer) -> str:
    """2 layers with head_dim 64 (3 query heads over 1 KV head): the int8 KV kernels' shapes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(7)
    cfg = LlamaConfig(hidden_size=192, num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=1,
                      head_dim=64, intermediate_size=256, vocab_size=49152, max_position_embeddings=2048,
                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, rope_theta=10000.0)
    path = tmp_path_factory.mktemp("head64_llama")
    LlamaForCausalLM(cfg).save_pretrained(str(path), safe_serialization=True)
    smollm2_tokenizer.save_pretrained(str(path))
    return str(path)


class Setup:
    def __init__(self, model_dir: str, dtype: torch.dtype, quantization: str | None, kv_cache_dtype: str) -> None:
        self.cfg = cfg = load_model_config(model_dir)
        self.model = build_model(cfg, dtype, "cpu")
        self.model.load_weights(iter_weights(model_dir, cfg))
        if quantization:
            self.model.set_quantization(quantization)
        self.pool = MHATokenToKVPool(512, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, dtype,
                                     kv_cache_dtype=kv_cache_dtype)
        self.attn = create_attention_backend("cpu", self.pool, cfg.num_attention_heads, cfg.num_key_value_heads,
                                             cfg.head_dim)
        self.table = torch.arange(1, 4 * 128 + 1).view(4, 128)
        self.gen = torch.Generator().manual_seed(0)

    def forward(self, mode: ForwardMode, rows: list[int], prefix: list[int], ext: list[int],
                out_rows: list[int] | None = None) -> tuple:
        """out_rows: the token rows whose outputs the model gives (all without)."""
        ids = torch.randint(5, self.cfg.vocab_size, (sum(ext),), generator=self.gen).tolist()
        loc = torch.cat([self.table[r, p:p + e] for r, p, e in zip(rows, prefix, ext)])
        fb = ForwardBatch.build(mode, ids, loc, rows, prefix, ext, self.table)
        self.attn.init_forward_metadata(fb)
        sel = None if out_rows is None else torch.tensor(out_rows, dtype=torch.int64)
        with torch.inference_mode():
            return fb, self.model.forward(fb, self.attn, sel)

    def kv(self) -> list[torch.Tensor]:
        return [t.clone() for t in self.pool.slot_buffers()]


def _count_fused(monkeypatch) -> list[int]:
    ran = [0]
    real = fused_decode.FusedDecode.forward

    def counting(self, *args):
        out = real(self, *args)
        ran[0] += out is not None
        return out
    monkeypatch.setattr(fused_decode.FusedDecode, "forward", counting)
    return ran


def _skip_unless_native_linears(s: Setup) -> None:
    for m in s.model.modules():
        if isinstance(m, Linear) and fused_decode._linear_spec(m, s.model.dtype) is None:
            pytest.skip("this CPU multiplies some linear outside radixlm's native GEMMs")


def _decode_both_ways(s: Setup, monkeypatch, ran: list[int], rows, prefix, ext=None, out_rows=None) -> bool:
    """One forward (a decode step, or extends of `ext` tokens; the outputs of `out_rows` only,
    when given) run fused, then again through the Python layers over the same KV state (it
    writes the same rows either way): equal outputs and KV. Whether the fused path ran."""
    mode = ForwardMode.DECODE if ext is None else ForwardMode.EXTEND
    ext = ext or [1] * len(rows)
    before = ran[0]
    monkeypatch.setenv("RADIXLM_FUSED_DECODE", "1")
    gen_state = s.gen.get_state()
    _, fused = s.forward(mode, rows, prefix, ext, out_rows)
    kv_fused = s.kv()
    took = ran[0] > before
    monkeypatch.setenv("RADIXLM_FUSED_DECODE", "0")
    s.gen.set_state(gen_state)
    _, plain = s.forward(mode, rows, prefix, ext, out_rows)
    assert ran[0] == before + took  # the switch is honoured
    assert fused.shape[0] == (sum(ext) if out_rows is None else len(out_rows))
    assert torch.equal(fused, plain)
    for a, b in zip(kv_fused, s.kv()):
        assert torch.equal(a, b)
    return took


CASES = [  # model fixture, dtype, quantization, KV cache dtype
    ("tiny_llama_dir", torch.float32, None, "auto"),
    ("tiny_llama_dir", torch.bfloat16, None, "auto"),
    ("tiny_qwen2_dir", torch.bfloat16, None, "auto"),  # q/k/v biases
    ("tiny_qwen2_dir", torch.float32, "w8a8_int8", "auto"),
    ("head64_llama_dir", torch.bfloat16, "w8a8_int8", "int8"),
    ("head64_llama_dir", torch.float32, "w8a8_int8", "int8"),
    ("head64_llama_dir", torch.bfloat16, None, "int8"),
    ("head64_llama_dir", torch.bfloat16, None, "auto"),  # the default bf16 path: the prefill kernel on a bf16 pool
]


@pytest.mark.parametrize("fixture,dtype,quantization,kv_cache_dtype", CASES)
def test_fused_decode_matches_python_layers(request, monkeypatch, fixture, dtype, quantization, kv_cache_dtype):
    if quantization and not cpu_ops.int8_linear_available():
        pytest.skip("no native int8 GEMM on this CPU")
    s = Setup(request.getfixturevalue(fixture), dtype, quantization, kv_cache_dtype)
    if kv_cache_dtype == "int8" and not s.attn.native_decode:
        pytest.skip("no native int8 decode attention on this CPU")
    _skip_unless_native_linears(s)
    ran = _count_fused(monkeypatch)
    # Short extends are decode-style rows (one per new token): fused too.
    assert _decode_both_ways(s, monkeypatch, ran, [0, 1, 2], [0, 0, 0], [30, 9, 17])
    # the MLP's SiLU * mul runs in the gate_up GEMM's epilogue (silu-gated packing)
    kinds = {spec.gate_up.kind for spec in s.model._fused_decode._table._keep[0]}
    if quantization:
        assert kinds == {native.INT8_SILU}
    elif dtype == torch.bfloat16 and cpu_ops.bf16_gemm_available():
        assert kinds == {native.BF16_PANELS_SILU}
    assert _decode_both_ways(s, monkeypatch, ran, [0, 1, 2], [30, 9, 17])
    assert _decode_both_ways(s, monkeypatch, ran, [3], [0], [5])
    assert _decode_both_ways(s, monkeypatch, ran, [2, 3, 0], [18, 5, 31])  # ragged, reordered
    assert _decode_both_ways(s, monkeypatch, ran, [1], [10])  # batch 1
    # A long extend (past SHORT_EXTEND) is fused where it takes the prefill kernel (bf16 on
    # AVX512-BF16), not where it takes SDPA.
    prefill_kernel = s.attn.native_extend
    assert _decode_both_ways(s, monkeypatch, ran, [1], [11], [80]) == prefill_kernel
    assert _decode_both_ways(s, monkeypatch, ran, [1], [91])
    # Several requests, with and without a cached prefix; the last layer for each request's last
    # token(s) only, or for none of them (a chunk that samples nothing).
    assert _decode_both_ways(s, monkeypatch, ran, [0, 2, 3], [5, 0, 40], [70, 100, 66]) == prefill_kernel
    assert _decode_both_ways(s, monkeypatch, ran, [0, 2], [0, 10], [90, 70], [89, 159]) == prefill_kernel
    assert _decode_both_ways(s, monkeypatch, ran, [0, 2], [0, 10], [90, 70], [88, 89, 159]) == prefill_kernel
    assert _decode_both_ways(s, monkeypatch, ran, [3, 1], [0, 0], [65, 120], []) == prefill_kernel
    # Rows forward_rows takes through its torch path (not each request's last tokens): not fused.
    assert not _decode_both_ways(s, monkeypatch, ran, [0, 2], [0, 10], [90, 70], [0, 159])


def test_fused_decode_takes_a_shared_prefix(tiny_llama_dir, monkeypatch):
    """A radix prefix shared by the whole batch is read in every request's row (the cpu
    backend has no cascade), so the step stays fused."""
    s = Setup(tiny_llama_dir, torch.float32, None, "auto")
    _skip_unless_native_linears(s)
    s.table[1:, :70] = s.table[0, :70]  # rows 1-3 share row 0's first 70 slots (a radix hit)
    ran = _count_fused(monkeypatch)
    s.forward(ForwardMode.EXTEND, [0], [0], [70])
    s.forward(ForwardMode.EXTEND, [1, 2, 3], [70, 70, 70], [3, 9, 1])
    assert _decode_both_ways(s, monkeypatch, ran, [0, 1, 2, 3], [70, 73, 79, 71])
    assert _decode_both_ways(s, monkeypatch, ran, [1], [74])


def test_fused_decode_rebuilds_after_weight_update_and_pool_reallocation(head64_llama_dir, monkeypatch):
    if not cpu_ops.int8_linear_available():
        pytest.skip("no native int8 GEMM on this CPU")
    s = Setup(head64_llama_dir, torch.bfloat16, "w8a8_int8", "auto")
    _skip_unless_native_linears(s)
    ran = _count_fused(monkeypatch)
    s.forward(ForwardMode.EXTEND, [0, 1], [0, 0], [12, 20])
    assert _decode_both_ways(s, monkeypatch, ran, [0, 1], [12, 20])
    fused = s.model._fused_decode
    table = fused._table
    # A weight update as the runner applies one (by name; the packed and int8 copies dropped,
    # then the int8 ones derived again).
    w = s.model.model.layers[1].mlp.down_proj.weight
    WeightUpdater(s.model).update([("model.layers.1.mlp.down_proj.weight", (w.float() * -1.5).to(w.dtype))])
    s.model.prepare_quantized()
    assert _decode_both_ways(s, monkeypatch, ran, [0, 1], [13, 21])
    assert fused._table is not table
    table = fused._table
    # The pool given back and allocated again (RL release/resume): new buffers, same KV content.
    kv = s.kv()
    s.pool.release()
    s.pool.allocate()
    for dst, src in zip(s.pool.slot_buffers(), kv):
        dst.copy_(src)
    assert _decode_both_ways(s, monkeypatch, ran, [0, 1], [14, 22])
    assert fused._table is not table
