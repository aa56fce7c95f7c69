"""The whole model with the native CPU kernels (cpu backend, fused norm/SiLU/RoPE) against
the same model on plain torch ops (torch_native backend, kernels switched off): same
logits for a prefill, a decode over a ragged batch and a decode over a shared prefix."""
from __future__ import annotations

import pytest
import torch

from radixlm.kernels.cpu import build as cpu_build
from radixlm.kernels.cpu import ops as cpu_ops
from radixlm.srt.model_runner.attention.base import create_attention_backend
from radixlm.srt.model_runner.forward_batch import ForwardBatch, ForwardMode
from radixlm.srt.model_runner.kv_pool import MHATokenToKVPool
from radixlm.srt.models.registry import build_model
from radixlm.srt.weights.loader import iter_weights, load_model_config

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="native CPU kernels could not be built")


def _run(model_dir: str, dtype: torch.dtype, backend: str) -> list[torch.Tensor]:
    cfg = load_model_config(model_dir)
    model = build_model(cfg, dtype, "cpu")
    model.load_weights(iter_weights(model_dir, cfg))
    pool = MHATokenToKVPool(512, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, dtype)
    attn = create_attention_backend(backend, pool, cfg.num_attention_heads, cfg.num_key_value_heads,
                                    cfg.head_dim)
    table = torch.zeros(4, 128, dtype=torch.int64)
    table[:, :] = torch.arange(1, 4 * 128 + 1).view(4, 128)
    table[1:, :70] = table[0, :70]  # rows 1-3 share row 0's first 70 slots (a radix hit)
    gen = torch.Generator().manual_seed(0)
    logits = []

    def forward(mode, rows, prefix, ext):
        ids = torch.randint(5, cfg.vocab_size, (sum(ext),), generator=gen).tolist()
        loc = torch.cat([table[r, p:p + e] for r, p, e in zip(rows, prefix, ext)])
        fb = ForwardBatch.build(mode, ids, loc, rows, prefix, ext, table)
        attn.init_forward_metadata(fb)
        if backend == "cpu" and mode == ForwardMode.DECODE:  # the native decode path is what runs
            assert type(fb.attn_metadata).__name__ == "_NativeDecode"
        with torch.inference_mode():
            logits.append(model.compute_logits(model.forward(fb, attn)))

    forward(ForwardMode.EXTEND, [0], [0], [70])
    forward(ForwardMode.EXTEND, [1, 2, 3], [70, 70, 70], [3, 9, 1])  # suffixes after the shared prefix
    forward(ForwardMode.DECODE, [0, 1, 2, 3], [70, 73, 79, 71], [1, 1, 1, 1])  # shared-prefix decode
    forward(ForwardMode.EXTEND, [0], [71], [20])
    forward(ForwardMode.DECODE, [3, 0, 2], [72, 91, 80], [1, 1, 1])  # ragged, no prefix worth sharing
    return logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_kernels_match_torch_ops(tiny_llama_dir, monkeypatch, dtype):
    native = _run(tiny_llama_dir, dtype, "cpu")
    monkeypatch.setattr(cpu_build, "_lib", None)  # kernels "unavailable": every layer takes torch ops
    monkeypatch.setattr(cpu_build, "_tried", True)
    assert not cpu_ops.available()
    plain = _run(tiny_llama_dir, dtype, "torch_native")
    tol = 1e-4 if dtype == torch.float32 else 0.1
    for a, b in zip(native, plain):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)
        assert torch.equal(a.argmax(-1), b.argmax(-1)) or dtype == torch.bfloat16
