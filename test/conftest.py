"""Shared fixtures: the default GGUF model path, its tokenizer, and tiny random
Hugging Face models (Llama, Qwen2) that use that tokenizer, for fast end-to-end tests."""
from __future__ import annotations

import os

# Tests must never touch the network (transformers/huggingface_hub read this at import).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pytest
import torch

TINY_SEED = 1234
TINY_VOCAB = 49152  # SmolLM2's tokenizer
TINY_SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, vocab_size=TINY_VOCAB, max_position_embeddings=2048,
                  bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: loads the real model or otherwise takes > 5 s (runs in CI; "
                                       "deselect locally with -m 'not slow')")


@pytest.fixture(scope="session")
def default_model_path() -> str:
    """The default GGUF, or RADIXLM_TEST_MODEL_PATH where the package cannot be installed (a
    lent GPU machine has no registry: test/gpu/device_stage.sh)."""
    from radixlm.srt.weights.loader import default_model_path as find

    if os.environ.get("RADIXLM_TEST_MODEL_PATH"):
        return os.environ["RADIXLM_TEST_MODEL_PATH"]
    try:
        return find()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def smollm2_tokenizer(default_model_path: str):
    """The SmolLM2 tokenizer (ChatML chat template), from the radixlm cache after the first run."""
    from radixlm.srt.weights.loader import load_tokenizer

    return load_tokenizer(default_model_path)


def _save_tiny(model, tokenizer, path) -> str:
    model.save_pretrained(str(path), safe_serialization=True)
    tokenizer.save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer) -> str:
    """A random 2-layer LlamaForCausalLM (float32, GQA 4/2 heads) + SmolLM2 tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(TINY_SEED)
    model = LlamaForCausalLM(LlamaConfig(**TINY_SHAPE, rope_theta=10000.0)).to(torch.float32)
    return _save_tiny(model, smollm2_tokenizer, tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer) -> str:
    """A random 2-layer Qwen2ForCausalLM (q/k/v biases) + SmolLM2 tokenizer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(TINY_SEED + 1)
    model = Qwen2ForCausalLM(Qwen2Config(**TINY_SHAPE, rope_theta=10000.0)).to(torch.float32)
    # HF initialises biases to zero; randomise them so the test actually checks them.
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0.0, 0.5)
    return _save_tiny(model, smollm2_tokenizer, tmp_path_factory.mktemp("tiny_qwen2"))


# The default model's attention shape (9 query heads over 3 KV heads, tied embeddings) at a
# tiny size: at tp_size 2 its groups split unevenly (2 + 1 KV heads, 6 + 3 query heads).
TINY_TP_SHAPE = dict(TINY_SHAPE, hidden_size=144, num_attention_heads=9, num_key_value_heads=3,
                     intermediate_size=256, tie_word_embeddings=True)


@pytest.fixture(scope="session")
def tiny_llama_tp_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer) -> str:
    """A random 2-layer LlamaForCausalLM shaped like SmolLM2's attention (9/3 heads, tied)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(TINY_SEED)
    model = LlamaForCausalLM(LlamaConfig(**TINY_TP_SHAPE, rope_theta=10000.0)).to(torch.float32)
    return _save_tiny(model, smollm2_tokenizer, tmp_path_factory.mktemp("tiny_llama_tp"))


# ---- Qwen3 and the mixture-of-experts families (test/support/moe_models.py) ----
@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer) -> str:
    """A random 3-layer Qwen3ForCausalLM (q/k norms, head_dim 32 != 96 / 4, tied embeddings)."""
    from test.support.moe_models import qwen3_dir
    return qwen3_dir(tmp_path_factory.mktemp("tiny_qwen3"), smollm2_tokenizer)


@pytest.fixture(scope="session")
def tiny_qwen3_moe_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer) -> str:
    """A random 4-layer Qwen3MoeForCausalLM: 8 experts, top 4, norm_topk_prob, layer 1 dense."""
    from test.support.moe_models import qwen3_moe_dir
    return qwen3_moe_dir(tmp_path_factory.mktemp("tiny_qwen3_moe"), smollm2_tokenizer)


@pytest.fixture(scope="session")
def tiny_mixtral_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer) -> str:
    """A random 2-layer MixtralForCausalLM: 4 experts, top 2."""
    from test.support.moe_models import mixtral_dir
    return mixtral_dir(tmp_path_factory.mktemp("tiny_mixtral"), smollm2_tokenizer)
