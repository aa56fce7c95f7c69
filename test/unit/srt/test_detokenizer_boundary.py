"""The detokenizer (srt/detokenizer_process.py). A request it cannot handle is ended alone
(`skip_special_tokens: "no"` once raised in the detokenizer, which dropped the whole batch,
so co-batched streams never got their final chunk); a non-streamed request is decoded once, at
its end."""
from __future__ import annotations

from radixlm.messages import BatchTokenOut, DetokParams, ReqOutput
from radixlm.srt.detokenizer_process import DetokenizerManager

BAD_TOKEN = 13


class CharTokenizer:
    """Token t decodes to chr(97 + t % 26); BAD_TOKEN cannot be decoded."""

    def decode(self, ids, skip_special_tokens=True, spaces_between_special_tokens=True):
        if not isinstance(skip_special_tokens, bool) or BAD_TOKEN in ids:
            raise TypeError("cannot decode")
        return "".join(chr(97 + t % 26) for t in ids)


def out(rid: str, ids: list[int], done: bool = False, first: bool = False) -> ReqOutput:
    return ReqOutput(rid=rid, new_token_ids=ids, finish_reason={"type": "length"} if done else None,
                     prompt_tokens=3, completion_tokens=0, cached_tokens=0,
                     detok=DetokParams() if first else None)


def test_one_failing_request_leaves_the_batch_delivered():
    m = DetokenizerManager(CharTokenizer())
    got = m.handle(BatchTokenOut([out("a", [0], first=True), out("bad", [BAD_TOKEN], first=True),
                                  out("b", [1], first=True)])).outputs
    assert [(o.out.rid, o.new_text, o.failed) for o in got] == [("a", "a", False), ("bad", "", True), ("b", "b", False)]
    fr = got[1].out.finish_reason
    assert fr["type"] == "abort" and fr["status_code"] == 500 and "detokenizing" in fr["message"]
    # later outputs of the failed request are dropped until its terminal one, which clears it
    got = m.handle(BatchTokenOut([out("bad", [2]), out("a", [2], done=True), out("b", [3], done=True)])).outputs
    assert [(o.out.rid, o.new_text) for o in got] == [("a", "c"), ("b", "d")]
    assert m.handle(BatchTokenOut([out("bad", [4], done=True)])).outputs == []
    assert not m.failed and not m.states


def test_bad_detok_params_fail_that_request_only():
    m = DetokenizerManager(CharTokenizer())
    bad = out("x", [1], first=True)
    bad.detok = DetokParams(skip_special_tokens="no")  # type: ignore[arg-type]  (validation stops this upstream)
    got = m.handle(BatchTokenOut([bad, out("y", [2], done=True, first=True)])).outputs
    assert got[0].failed and got[1].new_text == "c" and not got[1].failed


def test_a_non_streamed_request_is_decoded_once_at_its_end():
    """DetokParams.text_at_end: the ids pass every step, the text comes whole with the last
    output (stop strings trimmed as the streaming path trims them)."""
    calls: list[list[int]] = []

    class Counting(CharTokenizer):
        def decode(self, ids, **kw):
            calls.append(list(ids))
            return super().decode(ids, **kw)

    m = DetokenizerManager(Counting())
    first = out("q", [0], first=True)
    first.detok = DetokParams(stop=("de",), text_at_end=True)
    streamed = out("s", [0], first=True)
    got = m.handle(BatchTokenOut([first, streamed])).outputs
    assert [(o.out.rid, o.new_text, o.out.new_token_ids) for o in got] == [("q", "", [0]), ("s", "a", [0])]
    decoded_for_s = len(calls)
    got = m.handle(BatchTokenOut([out("q", [1, 2]), out("q", [3, 4, 5], done=True)])).outputs
    assert [(o.new_text, o.out.new_token_ids) for o in got] == [("", [1, 2]), ("abc", [3, 4, 5])]
    assert calls[decoded_for_s:] == [[], [0, 1, 2, 3, 4, 5]]  # one decode of the whole output
    assert "q" not in m.states


def test_released_text_holds_back_what_a_stream_would():
    from radixlm.srt.detokenizer import released_text
    tok = CharTokenizer()
    assert released_text(tok, DetokParams(), [0, 1, 2]) == "abc"
    assert released_text(tok, DetokParams(stop=("cd",)), [0, 1, 2]) == "ab"  # "c" may start "cd"
    assert released_text(tok, DetokParams(stop=("b",)), [0, 1, 2]) == "a"
