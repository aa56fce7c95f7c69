"""The family checks (test/support/family_checks.py) on a tiny Gemma 3 and a tiny Gemma 2: logits
and 32-token greedy continuations against transformers through every engine path (plain, cached
prefix, chunked prefill, forced retraction, --tp-size 2), with a sliding window of 8 that the
longer prompts, the shared prefixes and the continuations all pass (prompts of 19 and 40 tokens,
prefill chunks of 5); Gemma 2 also soft-caps its scores and logits."""
from __future__ import annotations

import pytest

from test.support.family_checks import VARIANTS, HFReference, check_greedy, check_logits
from test.support.tiny_models import TINY_DENSE_SHAPE, randomize_norms, save_tiny_model

CHUNK = 5  # shorter than the window: a chunk's sliding layers read earlier chunks' keys
WINDOW = 8


@pytest.fixture(scope="session")
def tiny_gemma3_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer) -> str:
    """4 layers (sliding, sliding, global, sliding), 4 query / 2 KV heads of 32, tied head, global
    rope scaled linearly, the sliding layers on their own rope base."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    shape = dict(TINY_DENSE_SHAPE, num_hidden_layers=4, head_dim=32, tie_word_embeddings=True)
    cfg = Gemma3TextConfig(**shape, sliding_window=WINDOW, sliding_window_pattern=3, query_pre_attn_scalar=24,
                           rope_theta=100000.0, rope_local_base_freq=1000.0,
                           rope_scaling={"rope_type": "linear", "factor": 2.0})
    return save_tiny_model(Gemma3ForCausalLM, cfg, tmp_path_factory.mktemp("tiny_gemma3"), smollm2_tokenizer,
                           seed=77, randomize=randomize_norms)


@pytest.fixture(scope="module")
def gemma3_ref(tiny_gemma3_dir) -> HFReference:
    return HFReference(tiny_gemma3_dir)


@pytest.mark.parametrize("backend", ["torch_native", "cpu"])
def test_logits_match_transformers(tiny_gemma3_dir, gemma3_ref, backend):
    check_logits(tiny_gemma3_dir, reference=gemma3_ref, backend=backend)


@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_matches_transformers(tiny_gemma3_dir, gemma3_ref, variant):
    check_greedy(tiny_gemma3_dir, variant, reference=gemma3_ref, chunk=CHUNK)


@pytest.fixture(scope="session")
def tiny_gemma2_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer) -> str:
    """3 layers (sliding, global, sliding), caps low enough to bend scores and logits."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    shape = dict(TINY_DENSE_SHAPE, num_hidden_layers=3, head_dim=32, tie_word_embeddings=True)
    cfg = Gemma2Config(**shape, sliding_window=WINDOW, query_pre_attn_scalar=24, attn_logit_softcapping=1.5,
                       final_logit_softcapping=2.5, initializer_range=0.1)
    return save_tiny_model(Gemma2ForCausalLM, cfg, tmp_path_factory.mktemp("tiny_gemma2"), smollm2_tokenizer,
                           seed=78, randomize=randomize_norms)


@pytest.fixture(scope="module")
def gemma2_ref(tiny_gemma2_dir) -> HFReference:
    return HFReference(tiny_gemma2_dir)


def test_gemma2_logits_match_transformers(tiny_gemma2_dir, gemma2_ref):
    check_logits(tiny_gemma2_dir, reference=gemma2_ref, backend="cpu")


@pytest.mark.parametrize("variant", VARIANTS)
def test_gemma2_greedy_matches_transformers(tiny_gemma2_dir, gemma2_ref, variant):
    check_greedy(tiny_gemma2_dir, variant, reference=gemma2_ref, chunk=CHUNK)
