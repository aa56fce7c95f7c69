"""SGLang's GenerateReqInput fields on /generate and the Engine: every one accepted at its
default value, the unsupported ones refused by name at any other value, extra_key and
cache_salt as prefix-cache namespaces, and the dispatcher's routing by data-parallel rank."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from radixlm.srt.fleet.dispatcher import requested_rank
from radixlm.srt.generate_request import normalize_generate
from radixlm.srt.openai_protocol import GenerateRequest
from radixlm.srt.sglang_fields import NEUTRAL_FIELDS, check_sglang_fields

# SGLang's GenerateReqInput, every field at its dataclass default (as its clients serialize it),
# with a prompt and sampling params.
SGLANG_DEFAULTS = {
    "rid": None, "session_id": None, "text": "Hello", "input_ids": None, "input_embeds": None,
    "image_data": None, "video_data": None, "audio_data": None, "mm_hashes": None, "mm_content_hashes": None,
    "use_audio_in_video": False, "video_config": None, "sampling_params": {"max_new_tokens": 3},
    "return_logprob": None, "logprob_start_len": None, "top_logprobs_num": None, "token_ids_logprob": None,
    "return_sampling_mask": None, "return_text_in_logprobs": False, "return_flat_raw_top_logprobs": False,
    "return_flat_raw_top_logprobs_b64": False, "stream": False, "log_metrics": True,
    "return_hidden_states": False, "return_routed_experts": False, "routed_experts_start_len": 0,
    "return_indexer_topk": False, "modalities": None, "session_params": None, "lora_path": None,
    "lora_id": None, "custom_logit_processor": None, "positional_embed_overrides": None,
    "bootstrap_host": None, "bootstrap_port": None, "bootstrap_room": None, "bootstrap_pair_key": None,
    "decode_tp_size": None, "routed_dp_rank": None, "data_parallel_rank": None,
    "disagg_prefill_dp_rank": None, "kv_router_hint": None, "routing_key": None, "conversation_id": None,
    "http_worker_ipc": None, "background": False, "require_reasoning": False, "max_thinking_tokens": None,
    "priority": None, "extra_key": None, "no_logs": False, "custom_labels": None, "return_bytes": False,
    "return_entropy": False, "return_prompt_token_ids": False, "external_trace_header": None,
    "received_time": None, "need_wait_for_mm_inputs": None, "num_items_assigned": None, "encoder_urls": None,
    "max_dynamic_patch": None, "min_dynamic_patch": None, "image_max_dynamic_patch": None,
    "video_max_dynamic_patch": None, "images_config": None, "multi_item_delimiter_indices": None,
    "cache_salt": None,
}
# What clients send other than null (the benchmark client's and the gateway's explicit values).
SENT_AT_NEUTRAL = {"return_routed_experts": False, "priority": 0, "data_parallel_rank": 0, "routed_dp_rank": 0,
                   "lora_path": [None], "image_data": [], "return_hidden_states": [False],
                   "stream_options": {"include_usage": True}, "model": "unknown",
                   "custom_labels": {"team": "a"}, "session_id": "s1"}


def _normalize(**kw):
    return normalize_generate(None, vocab_size=100, context_len=64, **kw)[0]


def test_the_full_field_set_at_defaults_is_accepted():
    body = GenerateRequest.model_validate({**SGLANG_DEFAULTS, **SENT_AT_NEUTRAL})
    kw = body.generate_kwargs()
    assert kw["prompt"] == "Hello" and "model" not in kw and "custom_labels" not in kw
    ids = {**kw, "input_ids": [1, 2, 3]}
    del ids["prompt"], ids["return_text_in_logprobs"]  # the tokenizer manager's own argument
    (item,) = _normalize(**ids)
    assert item.input_ids == [1, 2, 3] and item.cache_key is None


# A value each unsupported field cannot take (right type, not neutral).
NON_NEUTRAL = {"image_data": "http://x/cat.png", "lora_path": "adapter", "return_routed_experts": True,
               "return_hidden_states": True, "data_parallel_rank": 1, "routed_dp_rank": 2, "background": True,
               "routed_experts_start_len": 3, "custom_logit_processor": "{}", "max_thinking_tokens": 9,
               "return_entropy": True, "return_bytes": True, "input_embeds": [[0.5]]}


@pytest.mark.parametrize("name,value", sorted(NON_NEUTRAL.items()))
def test_a_non_neutral_value_is_refused_by_name(name, value):
    GenerateRequest.model_validate({"text": "x", name: value})  # the type is right...
    with pytest.raises(ValueError, match=f"^{name}=.*not supported"):  # ...the value is not
        _normalize(input_ids=[1, 2], **{name: value})


def test_every_neutral_field_is_in_the_body_model():
    assert set(NEUTRAL_FIELDS) <= set(GenerateRequest.model_fields)
    for name in NEUTRAL_FIELDS:
        check_sglang_fields({name: None})


@pytest.mark.parametrize("body", [{"return_routed_experts": "no"}, {"priority": "0"}, {"extra_key": 5},
                                  {"stream_options": {"include_usage": "yes"}}, {"data_parallel_rank": -1},
                                  {"custom_labels": {"a": 1}}, {"return_routed_expert": False}])
def test_types_stay_strict(body):
    with pytest.raises(ValidationError):
        GenerateRequest.model_validate({"text": "x", **body})


def test_engine_keywords_are_checked_alike():
    with pytest.raises(ValueError, match="return_routed_expert: unknown field"):
        _normalize(input_ids=[1], return_routed_expert=False)
    with pytest.raises(ValueError, match="stream_options.include_usage must be a boolean"):
        _normalize(input_ids=[1], stream_options={"include_usage": 1})
    with pytest.raises(ValueError, match="extra_key must be a string"):
        _normalize(input_ids=[1], extra_key=3)
    with pytest.raises(ValueError, match="extra_key has 1 entries but there are 2 prompts"):
        _normalize(input_ids=[[1], [2]], extra_key=["a"])


def test_extra_key_and_cache_salt_are_one_namespace_per_prompt():
    a, b = _normalize(input_ids=[[1], [2]], extra_key=["k", ""], cache_salt="s")
    assert a.cache_key == "extra_key=k&cache_salt=s" and b.cache_key == "cache_salt=s"
    (c,) = _normalize(input_ids=[1], extra_key="k")
    assert c.cache_key != a.cache_key
    (d,) = _normalize(input_ids=[1], sampling_params={"n": 2}, extra_key="k")
    assert {r.extra_key for r in d.expand()} == {"extra_key=k"}  # every child of n > 1 shares it


def test_the_dispatcher_routes_by_rank():
    assert requested_rank({"text": "x"}, 2) is None
    assert requested_rank({"text": "x", "data_parallel_rank": 1}, 2) == 1
    assert requested_rank({"routed_dp_rank": 0, "data_parallel_rank": 0}, 2) == 0
    for bad in ({"data_parallel_rank": 2}, {"routed_dp_rank": -1}, {"routed_dp_rank": True},
                {"routed_dp_rank": 0, "data_parallel_rank": 1}):
        with pytest.raises(ValueError):
            requested_rank(bad, 2)


def test_the_dispatcher_sends_a_ranked_request_to_that_replica_without_the_rank():
    import httpx
    import orjson
    from starlette.testclient import TestClient

    from radixlm.srt.fleet.dispatcher import create_dispatcher_app

    seen: list[tuple[str, dict]] = []

    def replica(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.host, orjson.loads(request.content or b"{}")))
        return httpx.Response(200, json={"text": "ok"})

    app = create_dispatcher_app(["http://r0", "http://r1", "http://r2"])
    with TestClient(app) as client:
        app.state.dispatcher.client = httpx.AsyncClient(transport=httpx.MockTransport(replica))
        for rank in (2, 0, 2):
            r = client.post("/generate", json={"text": "same prompt", "data_parallel_rank": rank})
            assert r.status_code == 200
        r = client.post("/v1/completions", json={"prompt": "x", "routed_dp_rank": 1})
        assert r.status_code == 200
        bad = client.post("/generate", json={"text": "x", "routed_dp_rank": 3})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "data_parallel_rank"
        # stored responses live on the first replica: /v1/responses and its id routes go there
        assert client.post("/v1/responses", json={"input": "x"}).status_code == 200
        assert client.delete("/v1/responses/resp_1").status_code == 200
    assert [host for host, _ in seen] == ["r2", "r0", "r2", "r1", "r0", "r0"]
    assert all(not {"data_parallel_rank", "routed_dp_rank"} & set(body) for _, body in seen)
