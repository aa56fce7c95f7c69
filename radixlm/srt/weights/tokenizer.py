"""Tokenizer loading, offline only (`local_files_only`; the runtime's child processes also run
with HF_HUB_OFFLINE=1, `radixlm.envs.CHILD_ENV`).

For a GGUF file, transformers rebuilds a fast tokenizer from the embedded vocab and
merges (~5 s); the result, chat template included, is saved next to the dequantized
weights in the radixlm cache and loaded from there afterwards (~0.4 s).
"""
from __future__ import annotations

import logging
import os
import shutil
from typing import Any

from radixlm.srt.weights.gguf_loader import gguf_cache_dir

logger = logging.getLogger(__name__)


def _auto_tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer


def load_tokenizer(path: str) -> Any:
    """A Hugging Face tokenizer for a model directory, a tokenizer directory or a GGUF file."""
    if os.path.isdir(path):
        return _auto_tokenizer().from_pretrained(path, local_files_only=True)
    if not path.endswith(".gguf"):
        raise ValueError(f"tokenizer path {path!r} is neither a directory nor a .gguf file")
    cached = os.path.join(gguf_cache_dir(path), "tokenizer")
    if os.path.isfile(os.path.join(cached, "tokenizer_config.json")):
        try:
            return _auto_tokenizer().from_pretrained(cached, local_files_only=True)
        except Exception as e:  # a corrupt cache must not block startup: rebuild it
            logger.warning("ignoring unreadable tokenizer cache %s: %s", cached, e)
    tok = _auto_tokenizer().from_pretrained(os.path.dirname(os.path.abspath(path)),
                                            gguf_file=os.path.basename(path), local_files_only=True)
    _save_cache(tok, cached)
    return tok


def _save_cache(tok: Any, cached: str) -> None:
    # Save into a private temp folder and rename it into place: concurrent processes
    # (pytest workers, two servers) then never read a half-written tokenizer.
    tmp = f"{cached}.tmp{os.getpid()}"
    try:
        os.makedirs(os.path.dirname(cached), exist_ok=True)
        tok.save_pretrained(tmp)
        if os.path.isdir(cached):
            shutil.rmtree(cached, ignore_errors=True)
        os.replace(tmp, cached)
    except OSError as e:
        logger.warning("could not cache tokenizer in %s: %s", cached, e)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
