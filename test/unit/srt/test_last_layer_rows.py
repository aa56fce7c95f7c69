"""The model's `rows` argument: only the tokens that become logits leave the last layer.

The last layer then runs its output projection, MLP and the final norm on those rows alone,
but it must still store every token's K/V: a later step that attends over them sees the same
cache as after a full forward."""
from __future__ import annotations

import pytest
import torch

from radixlm.srt.model_runner.attention.base import create_attention_backend
from radixlm.srt.model_runner.forward_batch import ForwardBatch, ForwardMode
from radixlm.srt.model_runner.kv_pool import MHATokenToKVPool
from radixlm.srt.models.registry import build_model
from radixlm.srt.weights.loader import iter_weights, load_model_config


class _Model:
    def __init__(self, model_dir: str, dtype: torch.dtype, backend: str) -> None:
        cfg = self.cfg = load_model_config(model_dir)
        self.model = build_model(cfg, dtype, "cpu")
        self.model.load_weights(iter_weights(model_dir, cfg))
        self.pool = MHATokenToKVPool(512, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, dtype)
        self.attn = create_attention_backend(backend, self.pool, cfg.num_attention_heads,
                                             cfg.num_key_value_heads, cfg.head_dim)
        self.table = torch.arange(1, 3 * 160 + 1, dtype=torch.int64).view(3, 160)

    def forward(self, mode, ids, reqs, prefix, ext, rows=None) -> torch.Tensor:
        loc = torch.cat([self.table[r, p:p + e] for r, p, e in zip(reqs, prefix, ext)])
        fb = ForwardBatch.build(mode, ids, loc, reqs, prefix, ext, self.table)
        self.attn.init_forward_metadata(fb)
        with torch.inference_mode():
            return self.model.forward(fb, self.attn, None if rows is None else torch.tensor(rows, dtype=torch.int64))

    def kv(self) -> list[torch.Tensor]:
        return [t.clone() for layer in range(self.cfg.num_hidden_layers) for t in self.pool.get_kv(layer)]


@pytest.mark.parametrize("backend", ["cpu", "torch_native"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_match_the_full_forward_and_every_kv_is_stored(tiny_llama_dir, backend, dtype):
    full, pruned = _Model(tiny_llama_dir, dtype, backend), _Model(tiny_llama_dir, dtype, backend)
    gen = torch.Generator().manual_seed(0)
    ext = [100, 37, 5]
    ids = torch.randint(5, full.cfg.vocab_size, (sum(ext),), generator=gen).tolist()
    # The runner's rows: each sampling request's last token, then prompt-logprob positions
    # (out of order, one of them repeated).
    rows = [99, 141, 3, 4, 5, 141]
    want = full.forward(ForwardMode.EXTEND, ids, [0, 1, 2], [0, 0, 0], ext)
    got = pruned.forward(ForwardMode.EXTEND, ids, [0, 1, 2], [0, 0, 0], ext, rows)
    assert got.shape == (len(rows), full.cfg.hidden_size)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want[rows], atol=tol, rtol=tol)
    for a, b in zip(full.kv(), pruned.kv()):
        assert torch.equal(a, b)  # the last layer's K/V of every token, not only of `rows`

    # A chunk that samples nothing (the middle of a chunked prefill): no rows at all.
    more = torch.randint(5, full.cfg.vocab_size, (40,), generator=gen).tolist()
    full.forward(ForwardMode.EXTEND, more, [0], [100], [40])
    none = pruned.forward(ForwardMode.EXTEND, more, [0], [100], [40], [])
    assert none.shape == (0, full.cfg.hidden_size)
    for a, b in zip(full.kv(), pruned.kv()):
        assert torch.equal(a, b)

    # Decoding over those caches gives the same logits.
    step = [7, 8, 9]
    a = full.model.compute_logits(full.forward(ForwardMode.DECODE, step, [0, 1, 2], [140, 37, 5], [1, 1, 1]))
    b = pruned.model.compute_logits(pruned.forward(ForwardMode.DECODE, step, [0, 1, 2], [140, 37, 5], [1, 1, 1],
                                                   [2, 0]))
    torch.testing.assert_close(b, a[[2, 0]], atol=tol * 10, rtol=tol * 10)


@pytest.fixture(scope="module")
def tiny_llama_d64_dir(tmp_path_factory, smollm2_tokenizer) -> str:
    """The tiny Llama with head_dim 64 (one of the prefill kernel's head sizes)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from test.conftest import TINY_SEED, TINY_SHAPE, _save_tiny

    torch.manual_seed(TINY_SEED)
    shape = dict(TINY_SHAPE, hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
    model = LlamaForCausalLM(LlamaConfig(**shape, rope_theta=10000.0)).to(torch.float32)
    return _save_tiny(model, smollm2_tokenizer, tmp_path_factory.mktemp("tiny_llama_d64"))


def test_the_prefill_kernel_attends_only_the_last_tokens_rows(tiny_llama_d64_dir, monkeypatch):
    """rows = each sampling request's last token: the cpu backend's prefill kernel gets those
    queries alone in the last layer (and the outputs still match the full forward)."""
    from radixlm.kernels.cpu import ops as cpu_ops
    from radixlm.srt.model_runner.attention import cpu as cpu_backend

    full, pruned = _Model(tiny_llama_d64_dir, torch.bfloat16, "cpu"), _Model(tiny_llama_d64_dir, torch.bfloat16, "cpu")
    if not pruned.attn.native_extend:
        pytest.skip("no native prefill kernel here (AVX512-BF16)")
    queries: list[int] = []
    kernel = cpu_ops.extend_attention

    def spy(q, *args, **kwargs):
        queries.append(q.shape[0])
        return kernel(q, *args, **kwargs)

    monkeypatch.setattr(cpu_backend.cpu_ops, "extend_attention", spy)
    # The Python layers, whose kernel calls the spy sees (the fused layers make the same calls
    # natively, bit for bit these: test_fused_decode.py).
    monkeypatch.setenv("RADIXLM_FUSED_DECODE", "0")
    gen = torch.Generator().manual_seed(1)
    ext = [100, 90, 70]
    ids = torch.randint(5, full.cfg.vocab_size, (sum(ext),), generator=gen).tolist()
    want = full.forward(ForwardMode.EXTEND, ids, [0, 1, 2], [0, 0, 0], ext)
    queries.clear()
    rows = [99, 189]  # requests 0 and 1 sample; request 2 is a chunk in the middle of its prompt
    got = pruned.forward(ForwardMode.EXTEND, ids, [0, 1, 2], [0, 0, 0], ext, rows)
    assert queries == [sum(ext)] * (full.cfg.num_hidden_layers - 1) + [2]
    torch.testing.assert_close(got, want[rows], atol=2e-2, rtol=2e-2)
    for a, b in zip(full.kv(), pruned.kv()):
        assert torch.equal(a, b)


def test_trailing_counts():
    from radixlm.srt.model_runner.attention.cpu import _trailing_counts

    assert _trailing_counts([4, 9], [5, 5]) == [1, 1]
    assert _trailing_counts([3, 4, 9], [5, 5]) == [2, 1]
    assert _trailing_counts([9], [5, 5]) == [0, 1]
    assert _trailing_counts([], [5, 5]) == [0, 0]
    assert _trailing_counts([3], [5, 5]) is None  # not the request's last token
    assert _trailing_counts([9, 4], [5, 5]) is None  # out of batch order
    assert _trailing_counts([4, 4], [5, 5]) is None  # a repeat
    assert _trailing_counts([4, 10], [5, 5]) is None  # past the batch
