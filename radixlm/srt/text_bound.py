"""Refusing a text too long for the context before tokenizing it.

Tokenizing a text of millions of characters takes tens of seconds and gigabytes, only to learn
that it does not fit. A token covers at most `max_chars_per_token` characters of the input, so a
text of C characters has at least C / max_chars_per_token tokens: when that is already the
whole context, the text is refused at once.

The bound must never refuse a text that would fit, so it is only used for tokenizers that
cannot make one token of more input than their longest vocabulary entry: byte-level or
Metaspace BPE with no unknown-token fusion, and normalizers that do not delete characters
(Unicode composition, NFC/NFKC, merges at most MAX_COMPOSITION characters into one). Byte-level
vocabularies write one character per byte, so an entry's length bounds the characters it
decodes to. Any other tokenizer (WordPiece, whose unknown word is one token; pre-tokenizers that
drop whitespace; slow tokenizers) gets no bound: its texts are tokenized and checked after.
"""
from __future__ import annotations

import json
import logging
from typing import Any

logger = logging.getLogger(__name__)

# Canonical composition joins a base and its marks (or a Hangul L+V+T) into one character.
MAX_COMPOSITION = 4
_COMPOSING = {"NFC", "NFKC"}
_LOSSLESS_NORMALIZERS = {"NFD", "NFKD", "Prepend", "Lowercase"}
_LOSSLESS_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Split", "Punctuation", "UnicodeScripts"}
_ATTR = "_radixlm_max_chars_per_token"


def _normalizer_factor(node: dict | None) -> int | None:
    """How many input characters the normalizer may turn into one (None: it may delete some)."""
    if node is None:
        return 1
    kind = node.get("type")
    if kind == "Sequence":
        factor = 1
        for child in node.get("normalizers", []):
            f = _normalizer_factor(child)
            if f is None:
                return None
            factor *= f
        return factor
    if kind in _COMPOSING:
        return MAX_COMPOSITION
    if kind in _LOSSLESS_NORMALIZERS:
        return 1
    if kind == "Replace":  # a fixed string for a non-empty one
        pattern, content = node.get("pattern", {}).get("String"), node.get("content") or ""
        if isinstance(pattern, str) and pattern and content:
            return max(1, -(-len(pattern) // len(content)))
    return None


def _pre_tokenizer_keeps_text(node: dict | None) -> bool:
    if node is None:
        return True
    kind = node.get("type")
    if kind == "Sequence":
        return all(_pre_tokenizer_keeps_text(c) for c in node.get("pretokenizers", []))
    if kind in ("Split", "Punctuation") and node.get("behavior") == "Removed":
        return False
    return kind in _LOSSLESS_PRE_TOKENIZERS


def compute_max_chars_per_token(tokenizer: Any) -> int | None:
    """The most input characters one token can stand for, or None when no safe bound is known."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        spec = json.loads(backend.to_str())
    except Exception:  # not a `tokenizers` backend we can read
        return None
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        return None
    byte_level = "ByteLevel" in json.dumps(spec.get("pre_tokenizer"))
    if model.get("fuse_unk") and not (byte_level or model.get("byte_fallback")):
        return None  # a run of unknown characters would be one token
    factor = _normalizer_factor(spec.get("normalizer"))
    if factor is None or not _pre_tokenizer_keeps_text(spec.get("pre_tokenizer")):
        return None
    entries = [len(k) for k in (model.get("vocab") or {})]
    entries += [len(a.get("content", "")) for a in spec.get("added_tokens") or []]
    if not entries:
        return None
    return max(entries) * factor


def max_chars_per_token(tokenizer: Any) -> int | None:
    """compute_max_chars_per_token, once per tokenizer object."""
    if tokenizer is None:
        return None
    cached = getattr(tokenizer, _ATTR, 0)
    if cached != 0:
        return cached
    bound = compute_max_chars_per_token(tokenizer)
    try:
        setattr(tokenizer, _ATTR, bound)
    except AttributeError:
        pass
    return bound


def check_text_length(tokenizer: Any, n_chars: int, context_len: int) -> None:
    """ValueError when a text of n_chars characters has at least context_len tokens for sure
    (the same refusal check_context gives after tokenizing, decided without it)."""
    per_token = max_chars_per_token(tokenizer)
    if per_token is None or n_chars < context_len * per_token:
        return
    at_least = -(-n_chars // per_token)
    raise ValueError(f"The input ({n_chars} characters, at least {at_least} tokens) is longer than the "
                     f"model's context length ({context_len} tokens).")
