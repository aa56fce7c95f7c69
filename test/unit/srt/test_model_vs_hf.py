"""Our Llama/Qwen2 + torch-native attention + KV pool against transformers, float32."""
from __future__ import annotations

import pytest
import torch

from radixlm.srt.models.registry import load_model
from radixlm.srt.weights.loader import load_model_config

PROMPT_LENS = (5, 17, 33)


def _prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _ours(path: str):
    cfg = load_model_config(path)
    return load_model(path, cfg, torch.float32, "cpu")


def _hf(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()


@pytest.fixture(scope="module")
def llama_pair(tiny_llama_dir):
    return _ours(tiny_llama_dir), _hf(tiny_llama_dir)


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()


def test_prefill_logits_all_positions(llama_pair, make_harness):
    ours, hf = llama_pair
    prompts = _prompts(ours.config.vocab_size)
    h = make_harness(ours)
    rows = [h.new_request() for _ in prompts]
    got = h.extend(rows, prompts)
    for ids, logits in zip(prompts, got):
        assert logits.shape == (len(ids), ours.config.vocab_size)
        torch.testing.assert_close(logits, _hf_logits(hf, ids), atol=1e-4, rtol=0)


def test_two_step_extend_equals_full_prefill(llama_pair, make_harness):
    ours, hf = llama_pair
    prompts = _prompts(ours.config.vocab_size, seed=1)
    h = make_harness(ours)
    rows = [h.new_request() for _ in prompts]
    cut = [2, 9, 20]
    h.extend(rows, [p[:c] for p, c in zip(prompts, cut)])
    # Second step mixes requests with a cached prefix and one starting from scratch.
    fresh = h.new_request()
    got = h.extend(rows + [fresh], [p[c:] for p, c in zip(prompts, cut)] + [prompts[0]])
    for ids, c, logits in zip(prompts, cut, got):
        torch.testing.assert_close(logits, _hf_logits(hf, ids)[c:], atol=1e-4, rtol=0)
    torch.testing.assert_close(got[-1], _hf_logits(hf, prompts[0]), atol=1e-4, rtol=0)


def test_greedy_decode_matches_hf_generate(llama_pair, make_harness):
    from transformers import GenerationConfig

    ours, hf = llama_pair
    prompts = _prompts(ours.config.vocab_size, seed=2)
    steps = 8
    h = make_harness(ours)
    rows = [h.new_request() for _ in prompts]
    last = [lg[-1] for lg in h.extend(rows, prompts)]
    tokens = [[int(lg.argmax())] for lg in last]
    for _ in range(steps - 1):
        logits = h.decode(rows, [t[-1] for t in tokens])
        for seq, lg in zip(tokens, logits):
            seq.append(int(lg.argmax()))
    # eos disabled so HF never stops early; greedy = argmax, like ours.
    gen_cfg = GenerationConfig(do_sample=False, max_new_tokens=steps, min_new_tokens=0,
                               eos_token_id=None, pad_token_id=0)
    for ids, seq in zip(prompts, tokens):
        with torch.inference_mode():
            out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              generation_config=gen_cfg)
        assert out[0, len(ids):].tolist() == seq


def test_decode_logits_match_after_free_and_reuse(llama_pair, make_harness):
    """Freed slots are reused by a new request: stale KV must not leak into it."""
    ours, hf = llama_pair
    a, b = _prompts(ours.config.vocab_size, seed=3)[1:]
    h = make_harness(ours, capacity=64)
    r1 = h.new_request()
    h.extend([r1], [b])
    h.free(r1)
    r2, r3 = h.new_request(), h.new_request()
    h.extend([r2, r3], [a[:-1], b[:-1]])
    logits = h.decode([r2, r3], [a[-1], b[-1]])
    torch.testing.assert_close(logits[0], _hf_logits(hf, a)[-1], atol=1e-4, rtol=0)
    torch.testing.assert_close(logits[1], _hf_logits(hf, b)[-1], atol=1e-4, rtol=0)


def test_qwen2_prefill_and_decode(tiny_qwen2_dir, make_harness):
    ours, hf = _ours(tiny_qwen2_dir), _hf(tiny_qwen2_dir)
    assert ours.config.attention_bias and ours.model.layers[0].self_attn.qkv_proj.bias is not None
    assert ours.model.layers[0].self_attn.o_proj.bias is None
    prompts = _prompts(ours.config.vocab_size, seed=4)
    h = make_harness(ours)
    rows = [h.new_request() for _ in prompts]
    got = h.extend(rows, [p[:-1] for p in prompts])
    for ids, logits in zip(prompts, got):
        torch.testing.assert_close(logits, _hf_logits(hf, ids[:-1]), atol=1e-4, rtol=0)
    dec = h.decode(rows, [p[-1] for p in prompts])
    for ids, logits in zip(prompts, dec):
        torch.testing.assert_close(logits, _hf_logits(hf, ids)[-1], atol=1e-4, rtol=0)


def test_bfloat16_close_to_float32(tiny_llama_dir, make_harness):
    cfg = load_model_config(tiny_llama_dir)
    prompts = _prompts(cfg.vocab_size, seed=5)
    outs = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = load_model(tiny_llama_dir, cfg, dtype, "cpu")
        h = make_harness(model, dtype=dtype)
        rows = [h.new_request() for _ in prompts]
        outs[dtype] = torch.cat(h.extend(rows, prompts))
    assert outs[torch.bfloat16].dtype == torch.float32  # compute_logits always returns float32
    scale = outs[torch.float32].abs().max()
    assert (outs[torch.bfloat16] - outs[torch.float32]).abs().max() < 0.05 * scale
