"""Structured output through the Engine on the tiny random Llama: a random model follows the
grammar only because of the mask, so full matches here show the mask and the matcher work.
Greedy outputs must be identical with the overlap scheduler on and off (semantics §7)."""
from __future__ import annotations

import json
import re

import pytest

from radixlm import Engine
from test.support.engine_checks import assert_kv_conserved
from test.support.structured import REGEXES, SCHEMA

pytest.importorskip("xgrammar")

PROMPTS = [[1, 5, 9, 100, 2000, 31], list(range(300, 340)), [40000, 12, 13]]


@pytest.fixture(scope="module")
def engines(tiny_llama_dir):
    made = {}
    try:
        for mode in ("overlap", "normal"):
            made[mode] = Engine(model_path=tiny_llama_dir, dtype="float32", max_total_tokens=4096,
                                chunked_prefill_size=64, debug_check_integrity=True,
                                disable_overlap_schedule=mode == "normal",
                                enable_overlap_schedule=mode == "overlap")
        yield made
    finally:
        for eng in made.values():
            eng.shutdown()


def _conserved(eng: Engine) -> None:
    assert assert_kv_conserved(eng)["num_grammar_queue_reqs"] == 0


def _batch():
    """Constrained and free requests mixed in one batch (all greedy)."""
    ids, params = [], []
    for i, rx in enumerate(REGEXES):
        ids.append(PROMPTS[i % len(PROMPTS)])
        params.append({"regex": rx, "max_new_tokens": 48, "temperature": 0})
    ids.append(PROMPTS[0])
    params.append({"json_schema": SCHEMA, "max_new_tokens": 120, "temperature": 0})
    ids.append(PROMPTS[1])
    params.append({"max_new_tokens": 10, "temperature": 0, "ignore_eos": True})
    return ids, params


def test_outputs_follow_the_grammar_and_overlap_agrees(engines):
    jsonschema = pytest.importorskip("jsonschema")
    ids, params = _batch()
    results = {mode: eng.generate(input_ids=ids, sampling_params=params) for mode, eng in engines.items()}
    for mode, outs in results.items():
        for rx, o in zip(REGEXES, outs):
            assert re.fullmatch(rx, o["text"]), (mode, rx, o["text"])
            assert o["meta_info"]["finish_reason"]["type"] == "stop"
        doc = json.loads(outs[len(REGEXES)]["text"])
        jsonschema.validate(doc, SCHEMA)
        assert outs[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 10}
    assert [o["output_ids"] for o in results["overlap"]] == [o["output_ids"] for o in results["normal"]]
    for eng in engines.values():
        _conserved(eng)


def test_parallel_samples_each_follow_the_grammar(engines):
    eng = engines["overlap"]
    outs = eng.generate(input_ids=PROMPTS[2], sampling_params={
        "regex": REGEXES[0], "n": 3, "temperature": 1.0, "seed": 5, "max_new_tokens": 48})
    assert len(outs) == 3
    for o in outs:
        assert re.fullmatch(REGEXES[0], o["text"]), o["text"]
    _conserved(eng)


def test_bad_grammars(engines):
    eng = engines["normal"]
    with pytest.raises(ValueError, match="only one of"):
        eng.generate(input_ids=PROMPTS[0], sampling_params={"regex": "a", "ebnf": 'root ::= "a"'})
    with pytest.raises(ValueError, match="not valid JSON"):
        eng.generate(input_ids=PROMPTS[0], sampling_params={"json_schema": "{oops"})
    # compiles fail in the scheduler: answered with 400, the good request beside them is unharmed
    outs = eng.generate(input_ids=[PROMPTS[0]] * 3, sampling_params=[
        {"regex": "[a-", "max_new_tokens": 8}, {"ebnf": "root ::= nowhere", "max_new_tokens": 8},
        {"regex": r"\d{3}", "max_new_tokens": 8, "temperature": 0}])
    for o in outs[:2]:
        fr = o["meta_info"]["finish_reason"]
        assert fr["type"] == "abort" and fr["status_code"] == 400 and fr["message"].startswith("invalid "), fr
        assert o["output_ids"] == []
    assert re.fullmatch(r"\d{3}", outs[2]["text"])
    _conserved(eng)


def test_stream_ends_with_the_grammar(engines):
    eng = engines["overlap"]
    chunks = list(eng.generate(input_ids=PROMPTS[1], sampling_params={
        "regex": REGEXES[1], "temperature": 0, "max_new_tokens": 32}, stream=True))
    text = "".join(c["text"] for c in chunks)
    assert re.fullmatch(REGEXES[1], text), text
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "stop"
    _conserved(eng)
