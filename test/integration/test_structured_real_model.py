"""Structured output on the real default model (SmolLM2-135M-Instruct): JSON schemas, a
regex and an EBNF grammar, on a KV pool small enough that constrained requests get retracted
and resumed (their matcher must continue where it was)."""
from __future__ import annotations

import ast
import json
import re

import pytest

from radixlm import Engine

pytestmark = pytest.mark.slow
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                 "zip": {"type": "string", "pattern": "[0-9]{5}"}},
                "required": ["city", "zip"], "additionalProperties": False}},
    "required": ["name", "age", "address"], "additionalProperties": False}
COLORS = {"type": "object", "properties": {
    "colors": {"type": "array", "items": {"enum": ["red", "green", "blue", "yellow"]},
               "minItems": 1, "maxItems": 3}},
    "required": ["colors"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {
    "temperature": {"type": "number", "minimum": -50, "maximum": 60},
    "humidity": {"type": "integer", "minimum": 0, "maximum": 100},
    "condition": {"enum": ["sunny", "cloudy", "rainy"]}},
    "required": ["temperature", "humidity", "condition"], "additionalProperties": False}
GROCERIES = {"type": "object", "properties": {
    "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 15},
                                         "price": {"type": "number", "minimum": 0, "maximum": 1000}},
        "required": ["name", "price"], "additionalProperties": False}}},
    "required": ["items"], "additionalProperties": False}
SCHEMA_QUESTIONS = [("Describe a person named Alice who lives in Paris as JSON.", PERSON),
                    ("List your favorite colors as JSON.", COLORS),
                    ("Give today's weather in London as JSON.", WEATHER),
                    ("List two grocery items with prices as JSON.", GROCERIES)]
PHONE = r"\d{3}-\d{3}-\d{4}"
ARITHMETIC = r'''root ::= expr
expr ::= term (space ("+" | "-") space term){0,3}
term ::= factor (space ("*" | "/") space factor){0,2}
factor ::= number | "(" expr ")"
number ::= [1-9] [0-9]{0,2}
space ::= " "?'''


@pytest.fixture(scope="module")
def engine(default_model_path):
    # A small pool and a tiny new-token reservation: admission overcommits, decode retracts.
    eng = Engine(model_path=default_model_path, dtype="float32", max_total_tokens=300,
                 schedule_conservativeness=0.05, debug_check_integrity=True)
    yield eng
    eng.shutdown()


def _chat(tok, q: str) -> list[int]:
    ids = tok.apply_chat_template([{"role": "user", "content": q}], tokenize=True, add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _arithmetic_ok(text: str) -> bool:
    tree = ast.parse(text, mode="eval")
    allowed = (ast.Expression, ast.BinOp, ast.Constant, ast.Add, ast.Sub, ast.Mult, ast.Div)
    return all(isinstance(n, allowed) for n in ast.walk(tree))


def _conserved(eng: Engine) -> None:
    eng.check_integrity()
    mem = eng.get_server_info()["memory"]
    assert mem["protected"] == 0 and mem["free"] + mem["evictable"] == mem["capacity"]


def test_schemas_regex_and_ebnf(engine):
    tok = engine.tokenizer
    ids = [_chat(tok, q) for q, _ in SCHEMA_QUESTIONS]
    params = [{"json_schema": s, "max_new_tokens": 128, "temperature": 0} for _, s in SCHEMA_QUESTIONS]
    ids.append(_chat(tok, "What is the phone number of the office? Answer like 555-123-4567."))
    params.append({"regex": PHONE, "max_new_tokens": 32, "temperature": 0})
    ids.append(_chat(tok, "Write an arithmetic expression that equals 42."))
    params.append({"ebnf": ARITHMETIC, "max_new_tokens": 64, "temperature": 0})
    outs = engine.generate(input_ids=ids, sampling_params=params)
    for (_, schema), o in zip(SCHEMA_QUESTIONS, outs):
        assert o["meta_info"]["finish_reason"]["type"] == "stop", o
        jsonschema.validate(json.loads(o["text"]), schema)
    assert re.fullmatch(PHONE, outs[-2]["text"]), outs[-2]["text"]
    assert _arithmetic_ok(outs[-1]["text"]), outs[-1]["text"]
    _conserved(engine)


def test_retracted_constrained_requests_still_validate(engine):
    tok = engine.tokenizer
    before = engine.get_server_info()["num_retractions"]
    questions = [("Describe a person named %s as JSON." % n, PERSON) for n in ("Bob", "Carla", "Dmitri", "Eve")]
    questions += [("List %s grocery items with prices as JSON." % k, GROCERIES) for k in ("three", "cheap", "fresh", "two")]
    outs = engine.generate(input_ids=[_chat(tok, q) for q, _ in questions],
                           sampling_params=[{"json_schema": s, "max_new_tokens": 128, "temperature": 0}
                                            for _, s in questions])
    for (_, schema), o in zip(questions, outs):
        assert o["meta_info"]["finish_reason"]["type"] == "stop", o
        jsonschema.validate(json.loads(o["text"]), schema)
    assert sum(o["meta_info"]["num_retractions"] for o in outs) > 0
    assert engine.get_server_info()["num_retractions"] > before
    _conserved(engine)
