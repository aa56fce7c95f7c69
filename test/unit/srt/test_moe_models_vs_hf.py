"""Qwen3, Qwen3-MoE and Mixtral against transformers, float32: logits of every prompt token over a
batch of prompts, then 32 greedy tokens decoded here equal to transformers' generate."""
from __future__ import annotations

import pytest
import torch

from radixlm.srt.layers.moe import SparseMoE
from radixlm.srt.models.registry import load_model
from radixlm.srt.weights.loader import load_model_config

PROMPT_LENS = (5, 17, 33, 64)
# float32 logits of these tiny models (|logit| < ~1) agree with transformers to ~1e-6; the
# tolerance leaves room for summation order (grouped experts, packed GEMMs), not for a wrong op.
ATOL = 2e-4
GREEDY_STEPS = 32


def _prompts(vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _hf(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()


def _hf_greedy(hf, ids: list[int], steps: int) -> list[int]:
    from transformers import GenerationConfig

    cfg = GenerationConfig(do_sample=False, max_new_tokens=steps, min_new_tokens=0, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          generation_config=cfg)
    return out[0, len(ids):].tolist()


def _greedy(h, prompts: list[list[int]], steps: int) -> list[list[int]]:
    rows = [h.new_request() for _ in prompts]
    tokens = [[int(lg[-1].argmax())] for lg in h.extend(rows, prompts)]
    for _ in range(steps - 1):
        for seq, lg in zip(tokens, h.decode(rows, [t[-1] for t in tokens])):
            seq.append(int(lg.argmax()))
    return tokens


FAMILIES = ["tiny_qwen3_dir", "tiny_qwen3_moe_dir", "tiny_mixtral_dir"]


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request):
    path = request.getfixturevalue(request.param)
    cfg = load_model_config(path)
    return path, load_model(path, cfg, torch.float32, "cpu"), _hf(path)


def test_config_read_from_the_checkpoint(tiny_qwen3_dir, tiny_qwen3_moe_dir, tiny_mixtral_dir):
    q3 = load_model_config(tiny_qwen3_dir)
    assert (q3.architecture, q3.head_dim, q3.tie_word_embeddings, q3.attention_bias) == \
        ("Qwen3ForCausalLM", 32, True, False)
    moe = load_model_config(tiny_qwen3_moe_dir)
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size, moe.norm_topk_prob) == (8, 4, 48, True)
    assert [moe.is_sparse_layer(i) for i in range(4)] == [True, False, True, True]
    mix = load_model_config(tiny_mixtral_dir)
    assert (mix.architecture, mix.num_experts, mix.num_experts_per_tok, mix.moe_intermediate_size) == \
        ("MixtralForCausalLM", 4, 2, 96)


def test_prefill_logits_match_hf(pair, make_harness):
    path, ours, hf = pair
    prompts = _prompts(ours.config.vocab_size, seed=11)
    h = make_harness(ours)
    got = h.extend([h.new_request() for _ in prompts], prompts)
    for ids, logits in zip(prompts, got):
        torch.testing.assert_close(logits, _hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_cached_prefix_extend_and_decode_match_hf(pair, make_harness):
    """A second extend over each request's cached first part, then one decode step."""
    path, ours, hf = pair
    prompts = _prompts(ours.config.vocab_size, seed=12)
    h = make_harness(ours)
    rows = [h.new_request() for _ in prompts]
    cut = [2, 9, 20, 40]
    h.extend(rows, [p[:c] for p, c in zip(prompts, cut)])
    got = h.extend(rows, [p[c:-1] for p, c in zip(prompts, cut)])
    for ids, c, logits in zip(prompts, cut, got):
        torch.testing.assert_close(logits, _hf_logits(hf, ids[:-1])[c:], atol=ATOL, rtol=0)
    dec = h.decode(rows, [p[-1] for p in prompts])
    for ids, logits in zip(prompts, dec):
        torch.testing.assert_close(logits, _hf_logits(hf, ids)[-1], atol=ATOL, rtol=0)


def test_greedy_continuations_equal_hf_generate(pair, make_harness):
    path, ours, hf = pair
    prompts = _prompts(ours.config.vocab_size, seed=13)
    got = _greedy(make_harness(ours), prompts, GREEDY_STEPS)
    for ids, seq in zip(prompts, got):
        assert seq == _hf_greedy(hf, ids, GREEDY_STEPS)


def test_sparse_and_dense_layers_where_the_config_says(tiny_qwen3_moe_dir):
    cfg = load_model_config(tiny_qwen3_moe_dir)
    model = load_model(tiny_qwen3_moe_dir, cfg, torch.float32, "cpu")
    kinds = [isinstance(layer.mlp, SparseMoE) for layer in model.model.layers]
    assert kinds == [True, False, True, True]
    assert all(layer.self_attn.q_norm.weight.shape == (32,) for layer in model.model.layers)


@pytest.mark.parametrize("norm_topk_prob,step,dense", [(False, 1, ()), (True, 2, ())])
def test_qwen3_moe_routing_variants(norm_topk_prob, step, dense, tmp_path, smollm2_tokenizer, make_harness):
    """Unnormalised top-k weights (transformers' default), and decoder_sparse_step 2 (layers 1
    and 3 sparse, 0 and 2 dense)."""
    from test.support.moe_models import qwen3_moe_dir

    path = qwen3_moe_dir(tmp_path / "m", smollm2_tokenizer, seed=40, norm_topk_prob=norm_topk_prob,
                         mlp_only_layers=dense, decoder_sparse_step=step)
    cfg = load_model_config(path)
    assert cfg.norm_topk_prob == norm_topk_prob and cfg.decoder_sparse_step == step
    ours, hf = load_model(path, cfg, torch.float32, "cpu"), _hf(path)
    assert [isinstance(layer.mlp, SparseMoE) for layer in ours.model.layers] == \
        [cfg.is_sparse_layer(i) for i in range(4)] == [step == 1, True, step == 1, True]
    prompts = _prompts(cfg.vocab_size, seed=14)
    h = make_harness(ours)
    for ids, logits in zip(prompts, h.extend([h.new_request() for _ in prompts], prompts)):
        torch.testing.assert_close(logits, _hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_unsupported_settings_are_one_line_errors(tiny_qwen3_dir, tmp_path):
    import json
    import shutil

    from radixlm.srt.weights.safetensors_loader import hf_model_config

    bad = tmp_path / "bad"
    shutil.copytree(tiny_qwen3_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(dict(cfg, use_sliding_window=True)))
    with pytest.raises(ValueError, match="use_sliding_window"):
        hf_model_config(str(bad))
    (bad / "config.json").write_text(json.dumps(dict(cfg, architectures=["Qwen3MoeForCausalLM"], num_experts=4,
                                                     num_experts_per_tok=6)))
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        hf_model_config(str(bad))


def test_native_attention_backend_runs_the_python_layers(pair, tiny_llama_dir, make_harness):
    """On the native CPU backend a decode step of these families must not take the fused native
    layer loop (it has no q/k norms nor MoE blocks): no table is built, and the logits are
    still transformers'. The plain Llama model in the same setting does build one, so this
    would see the guard gone."""
    from radixlm.kernels.cpu import ops as cpu_ops

    if not cpu_ops.available():
        pytest.skip("native CPU kernels could not be built")
    path, ours, hf = pair
    prompts = _prompts(ours.config.vocab_size, seed=15)
    h = make_harness(ours, backend="cpu")
    rows = [h.new_request() for _ in prompts]
    h.extend(rows, [p[:-1] for p in prompts])
    dec = h.decode(rows, [p[-1] for p in prompts])
    assert ours._fused_decode._table is None
    for ids, logits in zip(prompts, dec):
        torch.testing.assert_close(logits, _hf_logits(hf, ids)[-1], atol=ATOL, rtol=0)
    llama = load_model(tiny_llama_dir, load_model_config(tiny_llama_dir), torch.float32, "cpu")
    hl = make_harness(llama, backend="cpu")
    rows = [hl.new_request() for _ in prompts]
    hl.extend(rows, [p[:-1] for p in prompts])
    hl.decode(rows, [p[-1] for p in prompts])
    assert llama._fused_decode._table is not None


# Measured on these tiny models (4 prompts, 119 positions): 112-117 of the 119 positions keep
# float32 transformers' top-1 under w8a8 (0.94-0.98, bf16 the lower); a broken int8 path (wrong scales, a transposed
# weight) drops to chance.
W8A8_TOP1 = 0.9


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w8a8_int8_top1_agrees_with_float32(pair, dtype, make_harness):
    path, _, hf = pair
    cfg = load_model_config(path)
    ours = load_model(path, cfg, dtype, "cpu")
    ours.set_quantization("w8a8_int8")
    prompts = _prompts(cfg.vocab_size, seed=16)
    h = make_harness(ours, dtype=dtype)
    got = h.extend([h.new_request() for _ in prompts], prompts)
    agree = total = 0
    for ids, logits in zip(prompts, got):
        ref = _hf_logits(hf, ids)
        agree += int((logits.argmax(-1) == ref.argmax(-1)).sum())
        total += len(ids)
    assert agree / total >= W8A8_TOP1, f"top-1 agreement {agree}/{total}"
