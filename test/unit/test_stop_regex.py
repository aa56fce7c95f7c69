"""stop_regex: validation, the scheduler's stop decision and the detokenizer's trim and
hold-back (SGLang's sampling parameter), on the real SmolLM2 tokenizer."""
from __future__ import annotations

import pytest

from radixlm.core import Req
from radixlm.sampling_params import SamplingParams
from radixlm.scheduler.output import StopStringChecker
from radixlm.srt.detokenizer import IncrementalDetokenizer
from radixlm.stop_regex import first_match, partial_start, verify_stop_regex


@pytest.mark.parametrize("bad", ["(", ".*", "a?", "", ["x"] * 17, "x" * 3000, 5, [5]])
def test_bad_patterns_are_value_errors(bad):
    with pytest.raises(ValueError):
        SamplingParams.from_dict({"stop_regex": bad}).verify()


def test_string_or_list():
    assert SamplingParams.from_dict({"stop_regex": r"\d+"}).stop_regex == [r"\d+"]
    assert SamplingParams.from_dict({"stop_regex": None}).stop_regex == []
    verify_stop_regex([r"\d+", r"(?i)done"])


def test_match_helpers():
    assert first_match([r"\d+", "b"], "ab12") == (1, 2, "b")
    assert first_match([r"\d+"], "ab12") == (2, 4, r"\d+")
    assert first_match([r"\d+\."], "ab12") is None
    assert partial_start([r"\d+\."], "ab12") == 2  # "12" may still become "12."
    assert partial_start([r"END"], "the EN") == 4
    assert partial_start([r"END"], "the X") is None


def _stream(tok, text, **kw):
    ids = tok.encode(text, add_special_tokens=False)
    det = IncrementalDetokenizer(tok, **kw)
    chunks = [det.add([t], finished=i == len(ids) - 1) for i, t in enumerate(ids)]
    return chunks, det


def test_detokenizer_trims_at_the_match_and_never_streams_past_it(smollm2_tokenizer):
    text = "The answer is 42. Then more text follows."
    chunks, det = _stream(smollm2_tokenizer, text, stop_regex=[r"\d+\."])
    assert "".join(chunks) == "The answer is "
    assert det.stopped
    assert not any(c and any(ch.isdigit() for ch in c) for c in chunks)  # "42" was held back, then cut
    kept, _ = _stream(smollm2_tokenizer, text, stop_regex=[r"\d+\."], no_stop_trim=True)
    assert "".join(kept) == "The answer is 42."


def test_detokenizer_releases_held_text_that_did_not_match(smollm2_tokenizer):
    text = "call 12 then 34 ok"
    chunks, det = _stream(smollm2_tokenizer, text, stop_regex=[r"\d+\."])
    assert "".join(chunks) == text and not det.stopped  # the held "12" came out once "12 " ruled it out
    held_at = [i for i, c in enumerate(chunks) if c.endswith("call")]
    assert held_at, chunks


def test_regex_and_string_stops_together_first_one_wins(smollm2_tokenizer):
    chunks, _ = _stream(smollm2_tokenizer, "alpha STOP beta 99", stop=["beta"], stop_regex=[r"STOP"])
    assert "".join(chunks) == "alpha "
    chunks, _ = _stream(smollm2_tokenizer, "alpha beta STOP", stop=["beta"], stop_regex=[r"STOP"])
    assert "".join(chunks) == "alpha "


def _req(tok, text, **sp):
    r = Req(rid="r", origin_input_ids=[1], sampling_params=SamplingParams.from_dict(sp))
    r.output_ids = tok.encode(text, add_special_tokens=False)
    return r


def test_scheduler_stops_on_the_token_that_completes_a_match(smollm2_tokenizer):
    checker = StopStringChecker(smollm2_tokenizer)
    ids = smollm2_tokenizer.encode("Order number 1234 shipped.", add_special_tokens=False)
    req = Req(rid="r", origin_input_ids=[1], sampling_params=SamplingParams.from_dict({"stop_regex": r"\d{4}"}))
    stopped_at = None
    for i, t in enumerate(ids):
        req.output_ids.append(t)
        checker.check(req)
        if req.finished:
            stopped_at = i
            break
    assert stopped_at is not None and req.finish_reason.matched == r"\d{4}"
    assert "1234" in smollm2_tokenizer.decode(req.output_ids)
    assert "1234" not in smollm2_tokenizer.decode(req.output_ids[:-1])


def test_unbounded_pattern_sees_the_whole_output(smollm2_tokenizer):
    filler = " word" * 60
    req = _req(smollm2_tokenizer, "BEGIN" + filler + " END", stop_regex=r"BEGIN.*END")
    StopStringChecker(smollm2_tokenizer).check(req)
    assert req.finish_reason is not None and req.finish_reason.type == "stop"


def test_min_new_tokens_delays_the_stop(smollm2_tokenizer):
    req = _req(smollm2_tokenizer, "12", stop_regex=r"\d", min_new_tokens=5, max_new_tokens=10)
    StopStringChecker(smollm2_tokenizer).check(req)
    assert req.finish_reason is None
