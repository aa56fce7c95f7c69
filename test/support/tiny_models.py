"""Tiny random-weight Hugging Face models saved to a directory (config.json + safetensors + the
SmolLM2 tokenizer), built from `transformers`' own config and model classes: the inputs of the
family checks (test/support/family_checks.py). A per-family test file writes a session fixture
that calls `save_tiny_model` with its config."""
from __future__ import annotations

import os
import shutil
from typing import Any, Callable

import torch

TINY_VOCAB = 49152  # SmolLM2's tokenizer
# A few layers, GQA (4 query heads over 2 KV heads), untied head: small enough for HF's generate
# and radixlm's engine to run dozens of 32-token continuations in seconds.
TINY_DENSE_SHAPE: dict[str, Any] = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, intermediate_size=128, vocab_size=TINY_VOCAB,
                                        max_position_embeddings=2048, bos_token_id=1, eos_token_id=2,
                                        tie_word_embeddings=False)


def save_tiny_model(model_cls: type, config: Any, path: str | os.PathLike, tokenizer: Any, seed: int,
                    randomize: Callable[[torch.nn.Module], None] | None = None) -> str:
    """Build `model_cls(config)` in float32 with `seed`, let `randomize` give non-zero values to
    what HF initialises to constants (biases, norms), and save it with `tokenizer` at `path`."""
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    if randomize is not None:
        with torch.no_grad():
            randomize(model)
    model.save_pretrained(str(path), safe_serialization=True)
    tokenizer.save_pretrained(str(path))
    return str(path)


def randomize_norms(model: torch.nn.Module, scale: float = 0.2) -> None:
    """HF initialises RMSNorm weights to ones (or zeros for (1 + w) norms): perturb them so a
    check sees a norm read from the wrong tensor or applied the wrong way."""
    for name, p in model.named_parameters():
        if "norm" in name:
            p.add_(torch.randn_like(p) * scale)


def perturbed_copy(model_dir: str, dest: str | os.PathLike, name: str, scale: float = 0.05, seed: int = 0) -> str:
    """A copy of a saved tiny model with one tensor moved by random noise of `scale`: a model
    that a check must tell apart from the original."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, dest)
    path = os.path.join(dest, "model.safetensors")
    state = load_file(path)
    g = torch.Generator().manual_seed(seed)
    state[name] = state[name] + scale * torch.randn(state[name].shape, generator=g)
    save_file(state, path, metadata={"format": "pt"})
    return str(dest)
