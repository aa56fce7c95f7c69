"""On CUDA: Triton kernels vs their torch twins, and the triton/flashinfer backends vs
torch_native, on random shapes and inside a model (greedy tokens).

Skipped without CUDA (conftest.py); triton/flashinfer parts skip without the package.
"""
from __future__ import annotations

import importlib.util
import warnings

import pytest
import torch

from radixlm.kernels.indices import build_indptr
from radixlm.kernels.reference import decode_attention_ref, extend_attention_ref
from radixlm.srt.model_runner.forward_batch import ForwardMode
from test.support.gpu_harness import KVWorld, make_backend
from test.support.model_harness import ModelHarness

HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
TOL = {torch.float32: 2e-4, torch.float16: 2e-2, torch.bfloat16: 6e-2}


def _backends_for(dtype: torch.dtype) -> list[str]:
    names = ["triton"] if HAS_TRITON else []
    if HAS_FLASHINFER and dtype != torch.float32:  # flashinfer kernels are fp16/bf16 only
        names.append("flashinfer")
    return names


def _pool(n: int, kv_heads: int, dim: int, dtype: torch.dtype, gen: torch.Generator):
    size = n + 100
    k = torch.full((size, kv_heads, dim), float("nan"), dtype=dtype, device="cuda")
    v = torch.full_like(k, float("nan"))
    slots = torch.randperm(size - 1, device="cuda", generator=gen)[:n] + 1
    k[slots] = torch.randn(n, kv_heads, dim, device="cuda", generator=gen).to(dtype)
    v[slots] = torch.randn(n, kv_heads, dim, device="cuda", generator=gen).to(dtype)
    return k, v, slots


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads", [(8, 8), (12, 4), (32, 4)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_kernels_match_twins_random(dtype, heads, head_dim):
    from radixlm.kernels.decode_attention import decode_attention_fwd
    from radixlm.kernels.extend_attention import extend_attention_fwd

    num_heads, kv_heads = heads
    gen = torch.Generator(device="cuda").manual_seed(head_dim + num_heads)
    lens = torch.randint(1, 700, (9,), generator=gen, device="cuda")
    lens[0] = 1
    k_buf, v_buf, slots = _pool(int(lens.sum()), kv_heads, head_dim, dtype, gen)
    q = torch.randn(9, num_heads, head_dim, device="cuda", generator=gen).to(dtype)
    indptr = build_indptr(lens)
    ref = decode_attention_ref(q, k_buf, v_buf, indptr, slots, head_dim ** -0.5)
    for splits in (1, 4, 16):
        out = decode_attention_fwd(q, k_buf, v_buf, indptr, slots, head_dim ** -0.5, num_kv_splits=splits)
        torch.testing.assert_close(out, ref, atol=TOL[dtype], rtol=TOL[dtype])

    prefix = torch.tensor([0, 1, 37, 513, 0, 200], device="cuda")
    ext = torch.tensor([300, 1, 77, 5, 128, 64], device="cuda")
    k_buf, v_buf, slots = _pool(int(prefix.sum()), kv_heads, head_dim, dtype, gen)
    t = int(ext.sum())
    q = torch.randn(t, num_heads, head_dim, device="cuda", generator=gen).to(dtype)
    k = torch.randn(t, kv_heads, head_dim, device="cuda", generator=gen).to(dtype)
    v = torch.randn(t, kv_heads, head_dim, device="cuda", generator=gen).to(dtype)
    args = (q, k, v, k_buf, v_buf, build_indptr(ext), build_indptr(prefix), slots)
    out = extend_attention_fwd(*args, int(ext.max()), head_dim ** -0.5)
    ref = extend_attention_ref(*args, head_dim ** -0.5)
    torch.testing.assert_close(out, ref, atol=TOL[dtype], rtol=TOL[dtype])


@needs_triton
def test_kv_ops_and_page_copy_cuda():
    from radixlm.kernels.kv_ops import store_kv
    from radixlm.kernels.page_copy import PageCopier
    from radixlm.kernels.reference import store_kv_ref

    k_buf = torch.zeros(1000, 8, 128, dtype=torch.bfloat16, device="cuda")
    v_buf = torch.zeros_like(k_buf)
    ek, ev = k_buf.clone(), v_buf.clone()
    loc = torch.randperm(999, device="cuda")[:300] + 1
    k, v = torch.randn(300, 8, 128, device="cuda"), torch.randn(300, 8, 128, device="cuda")
    store_kv(k_buf, v_buf, loc, k, v)
    store_kv_ref(ek, ev, loc, k, v)
    assert torch.equal(k_buf, ek) and torch.equal(v_buf, ev)

    dev = [torch.randn(500, 8, 128, device="cuda").half() for _ in range(8)]
    host = [torch.zeros(900, 8, 128, dtype=torch.float16) for _ in range(8)]
    copier = PageCopier(dev, host)
    d_slots, h_slots = torch.randperm(499)[:128] + 1, torch.randperm(899)[:128] + 1
    copier.device_to_host(d_slots, h_slots)
    assert all(torch.equal(h[h_slots], d[d_slots.cuda()].cpu()) for d, h in zip(dev, host))
    back = torch.randperm(499)[:128] + 1
    before = [d[d_slots.cuda()].clone() for d in dev]
    copier.host_to_device(h_slots, back)
    assert all(torch.equal(d[back.cuda()], b) for d, b in zip(dev, before))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads", [(8, 8), (12, 4), (32, 4)])
def test_backends_match_torch_native_random(dtype, heads):
    names = _backends_for(dtype)
    if not names:
        pytest.skip("no GPU backend installed for this dtype")
    num_heads, kv_heads, dim = *heads, 128
    world = KVWorld(40000, kv_heads, dim, dtype, max_reqs=16, max_context=4096)
    backends = {n: make_backend(n, world, num_heads, kv_heads, dim) for n in ["torch_native", *names]}
    gen = torch.Generator(device="cuda").manual_seed(num_heads)
    schedule = [(ForwardMode.EXTEND, [0, 1, 2], [700, 1, 33]),
                (ForwardMode.EXTEND, [3, 0, 1], [129, 64, 2000]),  # cached prefixes + a new request
                *[(ForwardMode.DECODE, [0, 1, 2, 3], [1, 1, 1, 1])] * 3]
    for mode, rows, ext in schedule:
        fb = world.step(mode, rows, ext)
        n = fb.num_tokens
        q = torch.randn(n, num_heads, dim, device="cuda", generator=gen).to(dtype)
        k = torch.randn(n, kv_heads, dim, device="cuda", generator=gen).to(dtype)
        v = torch.randn(n, kv_heads, dim, device="cuda", generator=gen).to(dtype)
        outs = {}
        for name, be in backends.items():  # every backend stores the same k/v at the same slots
            fb.attn_metadata = None
            be.init_forward_metadata(fb)
            outs[name] = be.forward(q, k, v, 0, fb, dim ** -0.5).float()
        for name in names:
            assert torch.isfinite(outs[name]).all(), name
            torch.testing.assert_close(outs[name], outs["torch_native"], atol=TOL[dtype], rtol=TOL[dtype],
                                       msg=f"{name} {mode}")


def _tiny_model(tmp_path, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    from radixlm.srt.models.registry import load_model
    from radixlm.srt.weights.loader import load_model_config

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=512, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                      intermediate_size=1024, vocab_size=1000, max_position_embeddings=4096,
                      rope_theta=10000.0, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(str(tmp_path), safe_serialization=True)
    return load_model(str(tmp_path), load_model_config(str(tmp_path)), dtype, "cuda")


def _teacher_forced(model, backend, dtype, prompts, steps, forced=None):
    """Logits of each step; decode inputs are `forced` tokens when given (so both backends
    see identical inputs), else the backend's own greedy picks."""
    h = ModelHarness(model, dtype, backend=backend, device="cuda")
    rows = [h.new_request() for _ in prompts]
    toks = [int(x[-1].argmax()) for x in h.extend(rows, prompts)]
    seq, logits = [toks], []
    for i in range(steps):
        inputs = forced[i] if forced is not None else toks
        lg = h.decode(rows, inputs).float()
        logits.append(lg)
        toks = lg.argmax(-1).tolist()
        seq.append(toks)
    return seq, logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_greedy_matches_torch_native(tmp_path, dtype):
    names = _backends_for(dtype)
    if not names:
        pytest.skip("no GPU backend installed for this dtype")
    model = _tiny_model(tmp_path, dtype)
    prompts = [list(range(3, 40)), [5, 6, 7], list(range(100, 400))]
    ref_seq, ref_logits = _teacher_forced(model, "torch_native", dtype, prompts, 8)
    for name in names:
        seq, logits = _teacher_forced(model, name, dtype, prompts, 8, forced=ref_seq)
        for a, b in zip(logits, ref_logits):
            torch.testing.assert_close(a, b, atol=10 * TOL[dtype], rtol=10 * TOL[dtype], msg=name)
        if dtype == torch.float32:
            assert seq == ref_seq, name  # fp32: greedy picks must be identical


def test_real_model_greedy_matches_torch_native(default_model_path):
    """The default model (SmolLM2-135M GGUF when present): 16 greedy tokens per backend,
    teacher-forced on torch_native's picks. float32: the same picks and logits within 1e-2.
    bf16: 30 layers of bf16 rounding in other summation orders move logits by more than one
    bf16 step of their size (0.125 at 16-32), so the picks are compared: at least 90% equal,
    and no logit off by more than 2."""
    from radixlm.srt.models.registry import load_model
    from radixlm.srt.weights.loader import load_model_config

    cfg = load_model_config(default_model_path)
    for dtype in (torch.float32, torch.bfloat16):
        names = _backends_for(dtype)
        model = load_model(default_model_path, cfg, dtype, "cuda")
        prompts = [[1, 504, 3458, 282, 4649, 314], [1, 17, 2000, 30, 44, 19, 8, 900, 7]]
        ref_seq, ref_logits = _teacher_forced(model, "torch_native", dtype, prompts, 16)
        for name in names:
            seq, logits = _teacher_forced(model, name, dtype, prompts, 16, forced=ref_seq)
            if dtype == torch.float32:
                for a, b in zip(logits, ref_logits):
                    torch.testing.assert_close(a, b, atol=1e-2, rtol=0.05, msg=name)
                assert seq == ref_seq, name
                continue
            worst = max(float((a - b).abs().max()) for a, b in zip(logits, ref_logits))
            picks = [x == y for s, r in zip(seq, ref_seq) for x, y in zip(s, r)]
            agree = sum(picks) / len(picks)
            warnings.warn(f"{name} bf16 vs torch_native: top-1 agreement {agree:.3f}, max |dlogit| {worst:.3f}",
                          stacklevel=1)  # the numbers reach the device log (warnings summary)
            assert agree >= 0.9 and worst <= 2.0, f"{name} bf16: top-1 agreement {agree:.3f}, max |dlogit| {worst:.3f}"
