"""A checkpoint's `generation_config.json`: the sampling defaults its authors chose, and its
extra end-of-sequence ids.

Like SGLang (`--sampling-defaults model`) and vLLM (`--generation-config auto`), radixlm uses the
model's temperature, top_p, top_k, min_p and repetition_penalty for every request that leaves
them unset: on the server (native and OpenAI routes), in the Engine and on the command line. A
GGUF file carries no generation config, so its requests get the plain defaults (temperature
1.0, top_p 1.0, top_k off). `do_sample` is ignored, as both of them ignore it: a request that
wants greedy decoding says temperature 0.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Any

logger = logging.getLogger(__name__)

FILE_NAME = "generation_config.json"
# The generation-config fields that are sampling defaults (the names SamplingParams uses too).
SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def read_generation_config(model_path: str) -> dict[str, Any]:
    """The checkpoint directory's generation config ({} when there is none: a GGUF file, a
    directory without one, or one that cannot be read, which is logged)."""
    path = os.path.join(model_path, FILE_NAME)
    if not os.path.isdir(model_path) or not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        logger.warning("ignoring %s: %s", path, e)
        return {}
    return cfg if isinstance(cfg, dict) else {}


def as_token_ids(value: Any) -> list[int]:
    """An `eos_token_id` entry (None, an int or a list) as a list."""
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def eos_token_ids(gen_config: dict[str, Any]) -> list[int]:
    """`eos_token_id` as a list (an int or a list in the file; chat models often list their
    end-of-turn token only here)."""
    return as_token_ids(gen_config.get("eos_token_id"))


def model_eos_ids(config_eos: Any, model_dir: str) -> tuple[int, ...]:
    """config.json's EOS ids, then those only the generation config lists (e.g. <|eot_id|>,
    Gemma 3's <end_of_turn>), in order, each once."""
    eos = as_token_ids(config_eos)
    for e in eos_token_ids(read_generation_config(model_dir)):
        if e not in eos:
            eos.append(e)
    return tuple(eos)


def sampling_defaults(gen_config: dict[str, Any]) -> dict[str, Any]:
    """The sampling fields the generation config sets (None values dropped)."""
    return {k: gen_config[k] for k in SAMPLING_DEFAULT_KEYS if gen_config.get(k) is not None}


def model_sampling_defaults(model_path: str) -> dict[str, Any]:
    """The checked sampling defaults: a value radixlm would refuse in a request is dropped
    (with a warning) instead of failing every request that leaves it unset."""
    from radixlm.sampling_params import SamplingParams

    defaults = sampling_defaults(read_generation_config(model_path))
    for key, value in list(defaults.items()):
        try:
            SamplingParams.from_dict({key: value}).verify()
        except ValueError as e:
            logger.warning("ignoring %s=%r of %s: %s", key, value, FILE_NAME, e)
            del defaults[key]
    return defaults


def with_sampling_defaults(sampling_params: Any, defaults: dict[str, Any]) -> Any:
    """`sampling_params` (None, a dict, or a list of them for a batch) with every default
    field it leaves unset (absent or null) filled in; other values (a SamplingParams object,
    which sets every field) are returned as they are. Nothing is changed in place."""
    if not defaults:
        return sampling_params
    if isinstance(sampling_params, list):
        return [with_sampling_defaults(sp, defaults) for sp in sampling_params]
    if sampling_params is None:
        return dict(defaults)
    if isinstance(sampling_params, dict):
        merged = dict(sampling_params)
        for k, v in defaults.items():
            if merged.get(k) is None:
                merged[k] = v
        return merged
    return sampling_params
