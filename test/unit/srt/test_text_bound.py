"""A text too long for the context is refused from its length alone, and only where the bound
is safe: the bound never exceeds the real token count, and tokenizers that can make one token
of arbitrarily much text get none."""
from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from radixlm.srt.text_bound import MAX_COMPOSITION, check_text_length, compute_max_chars_per_token


def _fast(tok: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def _bpe(normalizer=None, pre_tokenizer=None, **kw) -> PreTrainedTokenizerFast:
    vocab = {"a": 0, "b": 1, " ": 2, "ab": 3, "abab": 4, "[UNK]": 5}
    tok = Tokenizer(models.BPE(vocab, [("a", "b"), ("ab", "ab")], unk_token="[UNK]", **kw))
    if normalizer is not None:
        tok.normalizer = normalizer
    if pre_tokenizer is not None:
        tok.pre_tokenizer = pre_tokenizer
    return _fast(tok)


def test_the_bound_holds_for_a_byte_level_vocabulary(smollm2_tokenizer):
    per_token = compute_max_chars_per_token(smollm2_tokenizer)
    assert per_token is not None and per_token >= 16
    rng = random.Random(0)
    longest = max(smollm2_tokenizer.get_vocab(), key=len)
    texts = [" " * 5000, "\n" + " " * 4000, "a " * 3000, smollm2_tokenizer.convert_tokens_to_string([longest]) * 50,
             "".join(chr(rng.randrange(32, 0x2FFF)) for _ in range(3000)), "<|im_start|>" * 200]
    for text in texts:
        n = len(smollm2_tokenizer.encode(text, add_special_tokens=False))
        assert n * per_token >= len(text), (text[:20], n, per_token)


def test_bounds_by_tokenizer_kind():
    assert compute_max_chars_per_token(_bpe(fuse_unk=False)) == 5  # "[UNK]" is the longest entry
    assert compute_max_chars_per_token(_bpe(normalizers.NFC(), fuse_unk=False)) == 5 * MAX_COMPOSITION
    assert compute_max_chars_per_token(_bpe(None, pre_tokenizers.Metaspace(), fuse_unk=False)) == 5
    # a run of unknown characters is one token, whitespace dropped, characters stripped: no bound
    assert compute_max_chars_per_token(_bpe(fuse_unk=True)) is None
    assert compute_max_chars_per_token(_bpe(None, pre_tokenizers.Whitespace(), fuse_unk=False)) is None
    assert compute_max_chars_per_token(_bpe(normalizers.StripAccents(), fuse_unk=False)) is None
    assert compute_max_chars_per_token(_bpe(normalizers.Replace(" ", ""), fuse_unk=False)) is None
    wordpiece = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    assert compute_max_chars_per_token(_fast(wordpiece)) is None
    assert compute_max_chars_per_token(object()) is None  # a slow tokenizer


def test_check_text_length_refuses_only_what_cannot_fit():
    tok = _bpe(fuse_unk=False)  # at most 5 characters a token
    check_text_length(tok, 5 * 100 - 1, 100)  # could be 100 tokens... or fewer: let it be tokenized
    with pytest.raises(ValueError, match=r"500 characters, at least 100 tokens.*context length \(100 tokens\)"):
        check_text_length(tok, 500, 100)
    text = "abab" * 125  # 500 characters in 125 tokens: the bound is below the truth
    assert len(tok.encode(text, add_special_tokens=False)) >= 100
    check_text_length(None, 10 ** 9, 100)  # no tokenizer, no bound
