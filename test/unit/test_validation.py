"""radixlm/validation.py: one set of rules for the Engine, /generate and the OpenAI routes."""
from __future__ import annotations

import pytest

from radixlm.sampling_params import TOP_K_ALL, SamplingParams
from radixlm.srt.generate_request import normalize_generate
from radixlm.srt.openai_protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest
from radixlm.validation import RequestLimits, check_nesting

# (sampling params, the field the message must name) — the fuzzer's inputs first
BAD_SAMPLING = [
    ({"seed": 1.5}, "seed"), ({"seed": "abc"}, "seed"), ({"seed": [1]}, "seed"),
    ({"skip_special_tokens": "no"}, "skip_special_tokens"), ({"temperature": "hot"}, "temperature"),
    ({"top_k": "5"}, "top_k"), ({"stop": 5}, "stop"), ({"logit_bias": [1]}, "logit_bias"),
    ({"logit_bias": {"1": 3.5e38}}, "logit_bias"), ({"logit_bias": {"x": 1.0}}, "logit_bias"),
    ({"logit_bias": {"-3": 1.0}}, "logit_bias"), ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"temperature": -1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"top_k": -2}, "top_k"), ({"min_p": 2}, "min_p"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"frequency_penalty": 3}, "frequency_penalty"), ({"max_new_tokens": -1}, "max_new_tokens"),
    ({"max_new_tokens": True}, "max_new_tokens"), ({"n": 0}, "n"), ({"n": 1000}, "n"),
    ({"stop": [""]}, "stop"), ({"stop": ["x" * 5000]}, "stop"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"json_schema": 5}, "json_schema"), ({"regex": ["a"]}, "regex"), ({"temprature": 0.5}, "temprature"),
    ({"min_new_tokens": 5, "max_new_tokens": 2}, "min_new_tokens"),
    ({"regex": "a" * 70000}, "regex"),
]


@pytest.mark.parametrize("params,field", BAD_SAMPLING)
def test_bad_sampling_params_raise_value_error_naming_the_field(params, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams.from_dict(params).verify(100)


def test_nulls_are_defaults_and_aliases_resolve():
    sp = SamplingParams.from_dict({"temperature": None, "frequency_penalty": None, "stop": None,
                                   "max_tokens": 7, "sampling_seed": 3, "top_k": 0, "stop_token_ids": None})
    assert (sp.temperature, sp.frequency_penalty, sp.stop, sp.max_new_tokens, sp.seed, sp.top_k) == \
        (1.0, 0.0, [], 7, 3, TOP_K_ALL)
    sp = SamplingParams.from_dict({"temperature": 1, "logit_bias": {"3": 2, 5: -1}, "stop": "x",
                                   "json_schema": {"type": "object"}, "top_p": 1e-300})
    assert sp.temperature == 1.0 and sp.logit_bias == {3: 2.0, 5: -1.0} and sp.stop == ["x"]
    assert sp.json_schema == '{"type": "object"}'


def test_fields_set_in_code_are_checked_too():
    sp = SamplingParams()
    sp.seed = 1.5
    with pytest.raises(ValueError, match="seed"):
        sp.verify()


def test_json_schema_nested_900_deep_is_a_value_error_not_a_recursion_error():
    schema: dict = {}
    cur = schema
    for _ in range(900):
        cur["properties"] = {"a": {}}
        cur = cur["properties"]["a"]
    with pytest.raises(ValueError, match="nested deeper"):
        SamplingParams.from_dict({"json_schema": schema}).verify()
    with pytest.raises(ValueError, match="nested deeper"):
        check_nesting([[[[1]]]], 3)
    check_nesting([[[1]]], 3)


def _normalize(**kw):
    return normalize_generate(None, vocab_size=100, context_len=64, limits=RequestLimits(max_n=4), **kw)


@pytest.mark.parametrize("kw,match", [
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 63}}, "context length"),
    ({"input_ids": [1] * 64}, "longer than"),
    ({"input_ids": [1, 2], "top_logprobs_num": 21}, "top_logprobs_num"),
    ({"input_ids": [1, 2], "top_logprobs_num": "3"}, "top_logprobs_num"),
    ({"input_ids": [1, 2], "return_logprob": "yes"}, "return_logprob"),
    ({"input_ids": [1, 2], "logprob_start_len": 1.5}, "logprob_start_len"),
    ({"input_ids": [1, 2], "sampling_params": {"n": 5}}, "--max-n"),
    ({"input_ids": [1, 2], "stream": "no"}, "stream"),
    ({"input_ids": [1, 2], "timeout": float("inf")}, "timeout"),
    ({"input_ids": {"a": 1}}, "input_ids"),
    ({"input_ids": [1, 2], "sampling_params": [1]}, "sampling_params"),
])
def test_request_level_checks(kw, match):
    with pytest.raises(ValueError, match=match):
        _normalize(**kw)


def test_default_max_new_tokens_is_clamped_later_not_rejected():
    items, _ = _normalize(input_ids=[1] * 60)  # default 128 > room left: the scheduler clamps it
    assert items[0].sampling_params.max_new_tokens == 128
    items, _ = _normalize(input_ids=[1] * 60, sampling_params={"max_new_tokens": 4})
    assert items[0].sampling_params.max_new_tokens == 4


def test_sequences_per_call_limit():
    limits = RequestLimits(max_sequences_per_request=5)
    with pytest.raises(ValueError, match="max-sequences-per-request"):
        normalize_generate(None, vocab_size=100, context_len=64, limits=limits, input_ids=[[1], [2], [3]],
                           sampling_params={"n": 2})


@pytest.mark.parametrize("model,body", [
    (CompletionRequest, {"prompt": "x", "n": "2"}), (CompletionRequest, {"prompt": "x", "top_p": 1.5}),
    (CompletionRequest, {"prompt": "x", "logit_bias": {"1": 3.5e38}}), (CompletionRequest, {"prompt": "x", "seed": 1.5}),
    (CompletionRequest, {"prompt": "x", "stream": "true"}), (CompletionRequest, {"prompt": "x", "echo": 1}),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}),
    (GenerateRequest, {"text": "x", "sampling_params": {"top_k": "5"}}),
    (GenerateRequest, {"text": "x", "sampling_params": {"frequency_penalty": "0"}}),
])
def test_request_models_are_strict(model, body):
    with pytest.raises(ValueError):
        model.model_validate(body)


def test_request_models_take_null_as_default():
    req = CompletionRequest.model_validate({"prompt": "x", "n": None, "stream": None, "temperature": None,
                                            "echo": None, "ignore_eos": None})
    assert req.n == 1 and req.stream is False and req.echo is False and req.temperature is None
    gen = GenerateRequest.model_validate({"text": "x", "stream": None, "sampling_params": {"temperature": None,
                                                                                          "max_new_tokens": 3}})
    assert gen.generate_kwargs() == {"prompt": "x", "sampling_params": {"max_new_tokens": 3}, "stream": False,
                                     "return_logprob": False, "return_text_in_logprobs": False}


def test_the_generate_route_model_takes_sglangs_aliases():
    """/generate's request model (what the gateway forwards) reads `sampling_seed` and
    `max_tokens` as seed and max_new_tokens, as parse_sampling_params does."""
    from pydantic import ValidationError

    from radixlm.srt.openai_protocol import GenerateRequest
    body = GenerateRequest.model_validate({"text": "x", "sampling_params": {"sampling_seed": 7, "max_tokens": 5}})
    assert body.generate_kwargs()["sampling_params"] == {"seed": 7, "max_new_tokens": 5}
    with pytest.raises(ValidationError, match="both"):
        GenerateRequest.model_validate({"text": "x", "sampling_params": {"sampling_seed": 7, "seed": 1}})
