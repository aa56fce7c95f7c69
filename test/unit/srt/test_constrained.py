"""Structured-output pieces below the scheduler: params validation, response_format, the
vocab mask in the sampler, and the xgrammar backend on the real tokenizer."""
from __future__ import annotations

import json
import math

import pytest
import torch

from radixlm.sampling_params import SamplingParams
from radixlm.srt.constrained import bitmask as bm
from radixlm.srt.constrained.response_format import response_format_to_sampling_params
from radixlm.srt.model_runner.sampler import Sampler, SamplingRow
from radixlm.srt.model_runner.sampling_batch import VocabMask


# ------------------------------------------------------------------ sampling params
def test_grammar_params_validation():
    sp = SamplingParams.from_dict({"json_schema": {"type": "object", "properties": {"b": {}, "a": {}}}})
    sp.verify()
    assert sp.grammar[0] == "json_schema" and list(json.loads(sp.grammar[1])["properties"]) == ["b", "a"]
    assert SamplingParams.from_dict({"regex": "a+"}).grammar == ("regex", "a+")
    assert SamplingParams().grammar is None
    for bad, msg in (({"regex": "a", "ebnf": "root ::= \"a\""}, "only one of"),
                     ({"json_schema": "{nope"}, "not valid JSON"),
                     ({"json_schema": "[1]"}, "JSON object"),
                     ({"regex": ""}, "non-empty")):
        with pytest.raises(ValueError, match=msg):
            SamplingParams.from_dict(bad).verify()


def test_response_format_conversion():
    f = response_format_to_sampling_params
    assert f(None) == {} and f({"type": "text"}) == {}
    assert json.loads(f({"type": "json_object"})["json_schema"]) == {"type": "object"}
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    got = f({"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": True}})
    assert json.loads(got["json_schema"]) == schema
    with pytest.raises(ValueError):
        f({"type": "xml"})
    with pytest.raises(ValueError):
        f({"type": "json_schema", "json_schema": {"name": "t", "schema": "{oops"}})


# ------------------------------------------------------------------ the mask in the sampler
def _mask(vocab: int, allowed: list[list[int] | None]) -> VocabMask:
    words = torch.zeros((len(allowed), bm.bitmask_width(vocab)), dtype=torch.int32)
    for i, toks in enumerate(allowed):
        if toks is None:
            words[i] = -1
            continue
        for t in toks:
            w = int(words[i, t // 32]) | (1 << (t % 32))
            words[i, t // 32] = w - (1 << 32) if w >= 1 << 31 else w
    return VocabMask(words, [i for i, a in enumerate(allowed) if a is not None])


def test_torch_fallback_matches_xgrammar_kernel():
    pytest.importorskip("xgrammar")
    g = torch.Generator().manual_seed(0)
    vocab = 100  # not a multiple of 32
    mask = VocabMask(torch.randint(-2**31, 2**31 - 1, (4, bm.bitmask_width(vocab)), dtype=torch.int32,
                                   generator=g), [0, 2, 3])
    logits = torch.randn(4, vocab, generator=g)
    a, b = logits.clone(), logits.clone()
    bm.apply_vocab_mask(a, mask)
    bm._apply_torch(b, mask, vocab)
    assert torch.equal(a, b)
    assert torch.equal(a[1], logits[1])  # unlisted row untouched


def _row(**kw) -> SamplingRow:
    return SamplingRow(SamplingParams.from_dict(kw), [0], [], stop_ids=frozenset({5}))


def test_sampler_draws_only_allowed_tokens_and_keeps_raw_logprobs():
    vocab = 40
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(1))
    allowed = [[3, 17, 33], None, [8]]
    rows = [_row(temperature=0), _row(temperature=0), _row(temperature=1.0, top_p=0.9)]
    rows[0].return_logprob = True
    s = Sampler(vocab)
    for _ in range(20):
        out = s.sample(logits, rows, vocab_mask=_mask(vocab, allowed))
        assert out.next_token_ids[0] == max(allowed[0], key=lambda t: logits[0, t])
        assert out.next_token_ids[1] == int(logits[1].argmax())
        assert out.next_token_ids[2] == 8
    raw = torch.log_softmax(logits[0], -1)[out.next_token_ids[0]].item()
    assert math.isclose(out.logprobs[0], raw, rel_tol=1e-5)  # the model's, not the masked one's


def test_grammar_wins_over_min_new_tokens_when_only_stop_is_allowed():
    vocab = 8
    logits = torch.zeros(2, vocab)
    rows = [SamplingRow(SamplingParams.from_dict({"temperature": 0, "min_new_tokens": 3}), [0], [],
                        stop_ids=frozenset({5})) for _ in range(2)]
    out = Sampler(vocab).sample(logits, rows, vocab_mask=_mask(vocab, [[5], [5, 6]]))
    assert out.next_token_ids == [5, 6]  # row 0: only the stop token is valid; row 1: min_new holds


# ------------------------------------------------------------------ xgrammar on the real tokenizer
@pytest.fixture(scope="module")
def backend(smollm2_tokenizer):
    pytest.importorskip("xgrammar")
    from radixlm.srt.constrained.xgrammar_backend import XGrammarBackend
    return XGrammarBackend(smollm2_tokenizer, 49152, [2])


def test_backend_compiles_and_masks(backend, smollm2_tokenizer):
    m = backend.new_matcher(backend.compile("regex", r"(yes|no)"))
    mask = bm.build_vocab_mask([m, None], 49152, "cpu")
    assert mask.rows == [0] and torch.all(mask.bitmask[1] == -1)
    logits = torch.zeros(2, 49152)
    bm.apply_vocab_mask(logits, mask)
    ok = torch.isfinite(logits[0]).nonzero().squeeze(1).tolist()
    texts = {smollm2_tokenizer.decode([t]) for t in ok}
    assert texts and all("yes".startswith(t) or "no".startswith(t) for t in texts)
    yes = smollm2_tokenizer.encode("yes", add_special_tokens=False)
    for t in yes:
        assert bm.advance_matchers([m], [t]) == [None]
    assert bm.advance_matchers([m], [2]) == ["terminated"]  # EOS ends the grammar
    assert bm.build_vocab_mask([m], 49152, "cpu") is None  # terminated: nothing to mask
    assert bm.advance_matchers([m], [7]) == [None]


def test_backend_reports_clean_errors(backend):
    for kind, spec in (("regex", "[a-"), ("json_schema", "{bad"), ("ebnf", "root ::= undefined_rule")):
        with pytest.raises(ValueError) as e:
            backend.compile(kind, spec)
        assert not str(e.value).startswith("["), str(e.value)  # C++ location prefix stripped


def test_a_matcher_that_raises_is_that_rows_error_only():
    class Boom:
        terminated = False

        def accept(self, token):
            raise RuntimeError("matcher broke")

    class Ok:
        terminated = False

        def accept(self, token):
            self.terminated = True
            return True
    assert bm.advance_matchers([Ok(), Boom(), None], [1, 2, 3]) == ["terminated", "error", None]
