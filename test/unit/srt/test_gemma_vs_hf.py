"""Gemma 3 and Gemma 2 (sliding-window and global layers, soft caps) against transformers,
float32, on the torch_native and cpu attention backends.

The tiny models have a window of 8 and prompts of 20-40 tokens, so every sliding layer drops
keys; the prompts also run in chunks shorter than the window and over a prefix shared with
another request (what the radix cache hands out), which must not change a logit.
"""
from __future__ import annotations

import pytest
import torch

from radixlm.srt.models.registry import load_model
from radixlm.srt.weights.loader import load_model_config
from test.support.model_harness import ModelHarness

PROMPT_LENS = (20, 33, 40)
WINDOW = 8
ATOL = 1e-4  # float32, both sides; logits are O(1)
BACKENDS = ("torch_native", "cpu")
SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=256, sliding_window=WINDOW,
             query_pre_attn_scalar=24, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _randomize_norms(model, seed: int) -> None:
    """HF initialises Gemma norms to w = 0 (scale 1): random w, so (1 + w) is really checked."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def _save(model, tmp_path_factory, name: str) -> str:
    path = str(tmp_path_factory.mktemp(name))
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory) -> str:
    """4 layers: sliding, sliding, global, sliding; global rope scaled (linear x2)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(31)
    cfg = Gemma3TextConfig(**SHAPE, sliding_window_pattern=3, rope_theta=100000.0, rope_local_base_freq=1000.0,
                           rope_scaling={"rope_type": "linear", "factor": 2.0})
    model = Gemma3ForCausalLM(cfg).to(torch.float32)
    _randomize_norms(model, 32)
    return _save(model, tmp_path_factory, "tiny_gemma3")


@pytest.fixture(scope="module")
def gemma2_dir(tmp_path_factory) -> str:
    """Alternating sliding/global layers, caps small enough to bend the scores and logits."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(41)
    cfg = Gemma2Config(**SHAPE, attn_logit_softcapping=1.5, final_logit_softcapping=2.5, rope_theta=10000.0,
                       initializer_range=0.1)  # scores and logits of several units: the caps bend them
    model = Gemma2ForCausalLM(cfg).to(torch.float32)
    _randomize_norms(model, 42)
    return _save(model, tmp_path_factory, "tiny_gemma2")


def _pair(path: str):
    from transformers import AutoModelForCausalLM

    cfg = load_model_config(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()
    return load_model(path, cfg, torch.float32, "cpu"), hf


@pytest.fixture(scope="module", params=["gemma3", "gemma2"])
def pair(request, gemma3_dir, gemma2_dir):
    return _pair(gemma3_dir if request.param == "gemma3" else gemma2_dir)


def _prompts(vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()


def test_config_reads_layer_kinds_and_ropes(gemma3_dir, gemma2_dir):
    g3, g2 = load_model_config(gemma3_dir), load_model_config(gemma2_dir)
    assert g3.layer_types == ("sliding_attention", "sliding_attention", "full_attention", "sliding_attention")
    assert [g3.layer_window(i) for i in range(4)] == [WINDOW, WINDOW, None, WINDOW]
    assert (g3.rope_theta, g3.rope_local_base_freq) == (100000.0, 1000.0)
    assert g3.rope_scaling is not None and g3.rope_scaling["rope_type"] == "linear"
    assert g3.attn_logit_softcapping is None and g3.final_logit_softcapping is None
    assert g3.hidden_activation == "gelu_pytorch_tanh" and g3.query_pre_attn_scalar == 24
    assert [g2.layer_window(i) for i in range(4)] == [WINDOW, None, WINDOW, None]
    assert (g2.attn_logit_softcapping, g2.final_logit_softcapping) == (1.5, 2.5)
    assert g2.rope_local_base_freq is None


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_logits_past_the_window(pair, backend):
    ours, hf = pair
    prompts = _prompts(ours.config.vocab_size, seed=0)
    h = ModelHarness(ours, backend=backend)
    rows = [h.new_request() for _ in prompts]
    for ids, logits in zip(prompts, h.extend(rows, prompts)):
        torch.testing.assert_close(logits, _hf_logits(hf, ids), atol=ATOL, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_chunks_shorter_than_the_window(pair, backend):
    """Chunks of 5 (the scheduler's chunked prefill): each chunk's sliding layers see the
    previous chunks' keys inside the window and none before."""
    ours, hf = pair
    prompts = _prompts(ours.config.vocab_size, seed=1)
    h = ModelHarness(ours, backend=backend)
    rows = [h.new_request() for _ in prompts]
    got: list[list[torch.Tensor]] = [[] for _ in prompts]
    for start in range(0, max(PROMPT_LENS), 5):
        live = [i for i, p in enumerate(prompts) if start < len(p)]
        out = h.extend([rows[i] for i in live], [prompts[i][start:start + 5] for i in live])
        for i, lg in zip(live, out):
            got[i].append(lg)
    for ids, parts in zip(prompts, got):
        torch.testing.assert_close(torch.cat(parts), _hf_logits(hf, ids), atol=ATOL, rtol=0)


def _share_prefix(h: ModelHarness, src: int, n: int) -> int:
    """A new request whose first n KV slots are src's (a radix cache hit)."""
    row = h.new_request()
    h.req_pool.req_to_token[row, :n] = h.req_pool.req_to_token[src, :n]
    h.lens[row] = n
    return row


@pytest.mark.parametrize("backend", BACKENDS)
def test_cached_prefix_longer_than_the_window(pair, backend):
    """Requests continuing a shared 24-token prefix (three windows) plus a fresh one in the same
    batch: the prefix's out-of-window keys are in the row but must not be attended."""
    ours, hf = pair
    a, b, c = _prompts(ours.config.vocab_size, seed=2)
    h = ModelHarness(ours, backend=backend)
    src = h.new_request()
    h.extend([src], [c])
    shared = 24
    b = c[:shared] + b[:16]
    r1, r2 = _share_prefix(h, src, shared), _share_prefix(h, src, shared)
    fresh = h.new_request()
    tail = c[:shared] + a[:3]  # three new tokens on the prefix
    out = h.extend([r1, r2, fresh], [b[shared:], tail[shared:], a])
    torch.testing.assert_close(out[0], _hf_logits(hf, b)[shared:], atol=ATOL, rtol=0)
    torch.testing.assert_close(out[1], _hf_logits(hf, tail)[shared:], atol=ATOL, rtol=0)
    torch.testing.assert_close(out[2], _hf_logits(hf, a), atol=ATOL, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_continuations_match_hf(pair, backend):
    """32 greedy tokens per prompt, batched decode, against Hugging Face's generate."""
    from transformers import GenerationConfig

    ours, hf = pair
    prompts = _prompts(ours.config.vocab_size, seed=3)
    steps = 32
    h = ModelHarness(ours, backend=backend)
    rows = [h.new_request() for _ in prompts]
    tokens = [[int(lg[-1].argmax())] for lg in h.extend(rows, prompts)]
    for _ in range(steps - 1):
        logits = h.decode(rows, [t[-1] for t in tokens])
        for seq, lg in zip(tokens, logits):
            seq.append(int(lg.argmax()))
    gen_cfg = GenerationConfig(do_sample=False, max_new_tokens=steps, min_new_tokens=0, eos_token_id=None,
                               pad_token_id=0)
    for ids, seq in zip(prompts, tokens):
        with torch.inference_mode():
            out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              generation_config=gen_cfg)
        assert out[0, len(ids):].tolist() == seq


def test_decode_after_refill_matches(pair):
    """A request dropped and recomputed from its tokens (a retraction) into other slots gives
    the same next-token logits as HF on the whole sequence."""
    ours, hf = pair
    ids = _prompts(ours.config.vocab_size, seed=4)[2]
    h = ModelHarness(ours, backend="cpu", capacity=128)
    first = h.new_request()
    h.extend([first], [ids[:30]])
    h.free(first)
    again = h.new_request()
    h.extend([again], [ids[:7]])  # refill in two chunks, then decode the rest token by token
    h.extend([again], [ids[7:25]])
    for i in range(25, len(ids)):
        logits = h.decode([again], [ids[i]])
        torch.testing.assert_close(logits[0], _hf_logits(hf, ids[:i + 1])[-1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("variant", ["bfloat16", "w8a8_int8", "int8_kv"])
def test_lower_precision_close_to_float32(gemma3_dir, variant):
    """bf16 weights (the cpu backend's windowed native prefill kernel for the 100-token prompt,
    windowed decode rows for the others), int8 linears and an int8 KV pool stay near the float32
    logits, past the window."""
    from radixlm.srt.model_runner.attention.base import create_attention_backend
    from radixlm.srt.model_runner.kv_pool import MHATokenToKVPool

    cfg = load_model_config(gemma3_dir)
    prompts = _prompts(cfg.vocab_size, seed=6) + [_prompts(cfg.vocab_size, seed=8)[2] * 2 + [7] * 20]
    ref = ModelHarness(load_model(gemma3_dir, cfg, torch.float32, "cpu"), backend="cpu")
    want = torch.cat(ref.extend([ref.new_request() for _ in prompts], prompts))
    dtype = torch.bfloat16 if variant == "bfloat16" else torch.float32
    model = load_model(gemma3_dir, cfg, dtype, "cpu")
    if variant == "w8a8_int8":
        model.set_quantization("w8a8_int8")
    h = ModelHarness(model, dtype=dtype, backend="cpu")
    if variant == "int8_kv":
        h.kv_pool = MHATokenToKVPool(4096, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, dtype,
                                     "cpu", kv_cache_dtype="int8")
        h.attn = create_attention_backend("cpu", h.kv_pool, cfg.num_attention_heads, cfg.num_key_value_heads,
                                          cfg.head_dim)
    got = torch.cat(h.extend([h.new_request() for _ in prompts], prompts))
    assert not torch.equal(got, want)  # it did run in lower precision
    got, want = got - got.mean(-1, keepdim=True), want - want.mean(-1, keepdim=True)
    assert torch.nn.functional.cosine_similarity(got, want, dim=-1).min().item() > 0.99  # every position


def test_image_text_checkpoint_serves_its_text_model(tmp_path):
    """A Gemma3ForConditionalGeneration directory (text_config nested, language_model.* names, a
    vision tower) loads as its text model: text-only prompts give the HF model's logits."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

    torch.manual_seed(51)
    text = Gemma3TextConfig(**SHAPE, sliding_window_pattern=2)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    hf = Gemma3ForConditionalGeneration(Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                                     mm_tokens_per_image=4, image_token_index=511,
                                                     boi_token_index=509, eoi_token_index=510)).eval()
    _randomize_norms(hf, 52)
    hf.save_pretrained(str(tmp_path), safe_serialization=True)
    cfg = load_model_config(str(tmp_path))
    assert cfg.architecture == "Gemma3ForConditionalGeneration" and cfg.sliding_window == WINDOW
    ours = load_model(str(tmp_path), cfg, torch.float32, "cpu")
    prompts = _prompts(500, seed=7)  # ids below the image tokens
    h = ModelHarness(ours, backend="cpu")
    for ids, logits in zip(prompts, h.extend([h.new_request() for _ in prompts], prompts)):
        with torch.inference_mode():
            want = hf(input_ids=torch.tensor([ids])).logits[0].float()
        torch.testing.assert_close(logits, want, atol=ATOL, rtol=0)


def _config_dir(tmp_path, cfg: dict, generation: dict | None = None) -> str:
    import json

    (tmp_path / "config.json").write_text(json.dumps(cfg))
    if generation is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    return str(tmp_path)


def test_older_config_files(tmp_path):
    """Configs as transformers 4.x wrote them for the published checkpoints: no layer_types (a
    sliding_window_pattern, or Gemma 2's alternation), rope_theta / rope_local_base_freq /
    rope_scaling at the top, the stop ids of generation_config.json."""
    gemma3 = dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", vocab_size=262144, hidden_size=1152,
                  intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1,
                  head_dim=256, query_pre_attn_scalar=256, sliding_window=512, sliding_window_pattern=6,
                  rope_theta=1000000.0, rope_local_base_freq=10000.0, rope_scaling=None, rms_norm_eps=1e-6,
                  max_position_embeddings=32768, final_logit_softcapping=None, attn_logit_softcapping=None,
                  hidden_activation="gelu_pytorch_tanh", eos_token_id=1)
    (tmp_path / "g3").mkdir()
    cfg = load_model_config(_config_dir(tmp_path / "g3", gemma3, {"eos_token_id": [1, 106]}))
    assert [cfg.layer_window(i) for i in range(12)] == [512] * 5 + [None] + [512] * 5 + [None]
    assert (cfg.rope_theta, cfg.rope_local_base_freq, cfg.rope_scaling) == (1000000.0, 10000.0, None)
    assert cfg.eos_token_ids == (1, 106) and cfg.tie_word_embeddings

    gemma2 = dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2", vocab_size=256000, hidden_size=3584,
                  intermediate_size=14336, num_hidden_layers=42, num_attention_heads=16, num_key_value_heads=8,
                  head_dim=256, query_pre_attn_scalar=256, sliding_window=4096, rope_theta=10000.0,
                  final_logit_softcapping=30.0, attn_logit_softcapping=50.0, hidden_act="gelu_pytorch_tanh",
                  hidden_activation="gelu_pytorch_tanh", max_position_embeddings=8192)
    (tmp_path / "g2").mkdir()
    cfg = load_model_config(_config_dir(tmp_path / "g2", gemma2))
    assert [cfg.layer_window(i) for i in range(4)] == [4096, None, 4096, None]
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (50.0, 30.0)
    assert cfg.rope_local_base_freq is None and cfg.rope_scaling is None

    (tmp_path / "bad").mkdir()
    with pytest.raises(ValueError, match="hidden_activation 'relu' is not supported"):
        load_model_config(_config_dir(tmp_path / "bad", dict(gemma3, hidden_activation="relu")))
