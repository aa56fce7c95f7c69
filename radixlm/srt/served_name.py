"""The name a server answers to: the model's name, not its file name.

`radixlm serve --model-path SmolLM2-135M-Instruct.Q4_1.gguf` serves `SmolLM2-135M-Instruct`
(what a user writes in `"model"`, and what vLLM and SGLang would call it); a Hugging Face
directory serves under its directory name (a hub cache snapshot under the repository's
`org/name`). `--served-model-name` replaces it. The older names (the file name, its stem with
the quantisation suffix, the path) stay accepted as aliases wherever a request names a model.

A GGUF's `general.name` is not used: converters often fill it with a training-run label
("Smollm2 135M 8k Lc100K Mix1 Ep2" for the default model), which nobody would type.
"""
from __future__ import annotations

import os
import re

# llama.cpp's quantisation type names as they end a file name: Q4_0, Q4_K_M, IQ3_XXS, Q8_0,
# F16, BF16 ..., after a '.', '-' or '_' (case-insensitive: q4_k_m.gguf is common too).
_QUANT_SUFFIX = re.compile(r"[._-](?:I?Q\d+(?:_[A-Z0-9]+)*|T[Q]\d_\d|F16|F32|BF16|FP16|FP32)$", re.IGNORECASE)
# A Hugging Face hub cache snapshot: .../models--org--name/snapshots/<commit>
_HUB_SNAPSHOT = re.compile(r"models--(?P<repo>[^/]+)/snapshots/[0-9a-f]{6,}$")


def _file_name(model_path: str) -> str:
    return os.path.basename(model_path.rstrip("/")) or model_path


def strip_quant_suffix(stem: str) -> str:
    bare = _QUANT_SUFFIX.sub("", stem)
    return bare or stem


def default_served_model_name(model_path: str) -> str:
    """`SmolLM2-135M-Instruct` for `.../SmolLM2-135M-Instruct.Q4_1.gguf`; the directory name
    of a Hugging Face checkpoint (`org/name` for a hub cache snapshot)."""
    snapshot = _HUB_SNAPSHOT.search(model_path.rstrip("/"))
    if snapshot:
        return snapshot.group("repo").replace("--", "/")
    name = _file_name(model_path)
    if name.lower().endswith(".gguf"):
        return strip_quant_suffix(name[:-5])
    return name


def model_name_aliases(model_path: str, served_model_name: str) -> set[str]:
    """Every name a request may give for this model: the served name, the default name, the
    file name with and without `.gguf` (the older served name), and the path itself."""
    name = _file_name(model_path)
    names = {served_model_name, default_served_model_name(model_path), model_path, name}
    if name.lower().endswith(".gguf"):
        names.add(name[:-5])
    return names
