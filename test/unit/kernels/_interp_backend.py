"""The triton attention backend inside the model, against torch_native (TRITON_INTERPRET=1).

Same tiny model, same request schedule (batched prefill, a radix-style prefix reuse,
chunked prefill, decode of mixed lengths) through both backends: greedy tokens must be
identical and logits close. A backend-level check with a NaN-poisoned pool follows.
"""
from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run via test_interpreter.py (needs TRITON_INTERPRET=1)", allow_module_level=True)
pytest.importorskip("triton")

import radixlm.srt.model_runner.attention.torch_native  # noqa: E402,F401  (registers)
from radixlm.srt.model_runner.attention.base import ATTENTION_BACKENDS, create_attention_backend  # noqa: E402
from radixlm.srt.model_runner.attention.triton import TritonAttention  # noqa: E402
from radixlm.srt.model_runner.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from radixlm.srt.model_runner.kv_pool import MHATokenToKVPool  # noqa: E402
from radixlm.srt.models.registry import load_model  # noqa: E402
from radixlm.srt.weights.loader import load_model_config  # noqa: E402
from test.support.kernel_batches import place_tokens, random_qkv  # noqa: E402
from test.support.model_harness import ModelHarness  # noqa: E402


def test_registered_and_created_by_name():
    assert ATTENTION_BACKENDS.get("triton") is TritonAttention
    pool = MHATokenToKVPool(8, 1, 2, 16, torch.float32)
    assert isinstance(create_attention_backend("triton", pool, 4, 2, 16), TritonAttention)


def _greedy_run(model, backend: str):
    """Greedy tokens and last logits of a fixed schedule exercising every extend shape."""
    h = ModelHarness(model, backend=backend)
    a, b = h.new_request(), h.new_request()
    logits = h.extend([a, b], [[5, 17, 300, 4000, 12, 9, 44], [7, 8, 9]])  # batched prefill
    toks = [int(x[-1].argmax()) for x in logits]
    seqs = [[t] for t in toks]
    for _ in range(3):
        toks = h.decode([a, b], toks).argmax(-1).tolist()
        for s, t in zip(seqs, toks):
            s.append(t)
    # A new request whose first chunk has no prefix, then a second chunk over it (chunked
    # prefill), batched with a decode-like one-token extend of request a.
    c = h.new_request()
    h.extend([c], [[100, 200, 300, 400, 500]])
    logits = h.extend([c, a], [[600, 700, 800], [toks[0]]])
    tc, ta = int(logits[0][-1].argmax()), int(logits[1][-1].argmax())
    seqs.append([tc])
    seqs[0].append(ta)
    toks = [ta, toks[1], tc]
    last = None
    for _ in range(3):
        last = h.decode([a, b, c], toks)
        toks = last.argmax(-1).tolist()
        for s, t in zip(seqs, toks):
            s.append(t)
    return seqs, last


def test_model_greedy_matches_torch_native(tiny_llama_dir):
    model = load_model(tiny_llama_dir, load_model_config(tiny_llama_dir), torch.float32, "cpu")
    ref_tokens, ref_logits = _greedy_run(model, "torch_native")
    tokens, logits = _greedy_run(model, "triton")
    assert tokens == ref_tokens
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)


def test_backend_matches_torch_native_on_poisoned_pool():
    """Both backends over one NaN-filled pool (only owned slots written): outputs agree."""
    heads, kv_heads, dim, cap = 6, 2, 32, 200
    gen = torch.Generator().manual_seed(0)
    pools = []
    for _ in range(2):
        pool = MHATokenToKVPool(cap, 1, kv_heads, dim, torch.float32)
        pool.k_buffer[0][1:] = float("nan")
        pool.v_buffer[0][1:] = float("nan")
        pools.append(pool)
    backends = [ATTENTION_BACKENDS.get("torch_native")(pools[0], heads, kv_heads, dim),
                TritonAttention(pools[1], heads, kv_heads, dim)]
    req_to_token = torch.randint(0, cap + 1, (4, 128), generator=gen)  # stale entries everywhere
    free = (torch.randperm(cap, generator=gen) + 1).tolist()
    lens = {0: 0, 1: 0, 2: 0}

    def step(mode, rows, ext):
        n = sum(ext)
        loc, prefix = place_tokens(req_to_token, free, lens, rows, ext)
        q, k, v = random_qkv(gen, n, heads, kv_heads, dim)
        outs = []
        for be in backends:
            fb = ForwardBatch.build(mode, [0] * n, loc, rows, prefix, ext, req_to_token)
            be.init_forward_metadata(fb)
            outs.append(be.forward(q, k, v, 0, fb, dim ** -0.5))
        assert torch.isfinite(outs[1]).all()
        torch.testing.assert_close(outs[1], outs[0], atol=2e-5, rtol=2e-5)

    step(ForwardMode.EXTEND, [0, 1], [9, 1])
    step(ForwardMode.EXTEND, [2, 0, 1], [4, 3, 21])  # empty prefix next to cached ones
    for _ in range(2):
        step(ForwardMode.DECODE, [1, 0, 2], [1, 1, 1])
    assert torch.equal(pools[0].k_buffer[0][1:].isnan(), pools[1].k_buffer[0][1:].isnan())
