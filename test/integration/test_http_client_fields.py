"""What clients nobody here wrote send, against a real `radixlm serve` on the tiny random Llama:
SGLang's full /generate field set at its defaults, extra_key as a cache namespace, tools
without a parser (an agent loop as LangChain and LiteLLM run it), and the fuzz findings'
answers (bootstrap lists, oversized texts, stop lists)."""
from __future__ import annotations

import json

import httpx
import pytest

from test.support.server import serving
from test.unit.srt.test_sglang_fields import SGLANG_DEFAULTS, SENT_AT_NEUTRAL


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    with serving(tiny_llama_dir, str(tmp_path_factory.mktemp("client_fields") / "server.log")) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base, timeout=60.0) as c:
        yield c


# ---------------------------------------------------------------------------- SGLang's /generate fields
def test_sglangs_full_field_set_at_defaults(http):
    r = http.post("/generate", json=SGLANG_DEFAULTS)
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["completion_tokens"] == 3
    r = http.post("/generate", json={**SGLANG_DEFAULTS, **SENT_AT_NEUTRAL})
    assert r.status_code == 200, r.text
    with http.stream("POST", "/generate", json={**SGLANG_DEFAULTS, **SENT_AT_NEUTRAL, "stream": True}) as s:
        assert s.status_code == 200 and b"[DONE]" in s.read()


@pytest.mark.parametrize("field,value", [("return_routed_experts", True), ("max_thinking_tokens", 9), ("lora_path", "a"),
                                         ("data_parallel_rank", 1)])
def test_an_unsupported_feature_is_a_400_naming_it(http, field, value):
    r = http.post("/generate", json={"text": "Hi", field: value})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith(f"{field}="), r.text


def test_extra_key_is_a_cache_namespace(http):
    prompt = "The quick brown fox jumps over the lazy dog. " * 4

    def cached(**kw) -> int:
        r = http.post("/generate", json={"text": prompt, "sampling_params": {"max_new_tokens": 1}, **kw})
        assert r.status_code == 200, r.text
        return r.json()["meta_info"]["cached_tokens"]

    cached(extra_key="tenant-a")
    assert cached(extra_key="tenant-a") > 0
    assert cached(extra_key="tenant-b") == 0
    assert cached() == 0 and cached(cache_salt="tenant-a") == 0  # neither the default nor a salt of that name


@pytest.mark.parametrize("top", [0, 2])
def test_token_ids_logprob_equal_transformers(http, tiny_llama_dir, top):
    """The logprobs of the asked ids at every prompt and output position, against the same
    weights' log_softmax in transformers."""
    import torch
    from transformers import AutoModelForCausalLM

    prompt, asked = [5, 17, 99, 3, 250, 7], [0, 42, 17, 1000]
    r = http.post("/generate", json={"input_ids": prompt, "return_logprob": True, "logprob_start_len": 0,
                                     "top_logprobs_num": top, "token_ids_logprob": asked,
                                     "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    out = r.json()
    meta = out["meta_info"]
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        lsm = torch.log_softmax(model(torch.tensor([prompt + out["output_ids"]])).logits[0].float(), dim=-1)
    inputs, outputs = meta["input_token_ids_logprobs"], meta["output_token_ids_logprobs"]
    assert inputs[0] is None and len(inputs) == len(prompt) and len(outputs) == 3
    for pos, entries in [(p - 1, inputs[p]) for p in range(1, len(prompt))] + \
                        [(len(prompt) - 1 + t, outputs[t]) for t in range(3)]:
        assert [tok for _, tok, _ in entries] == asked
        assert [lp for lp, _, _ in entries] == pytest.approx(lsm[pos, asked].tolist(), abs=2e-3)
    assert all(len(t) == top for t in meta["output_top_logprobs"])
    assert len(meta["input_top_logprobs"]) == (len(prompt) if top else 0)
    with http.stream("POST", "/generate", json={"input_ids": prompt, "return_logprob": True, "stream": True,
                                                "token_ids_logprob": asked, "sampling_params": {
                                                    "max_new_tokens": 3, "temperature": 0, "ignore_eos": True}}) as s:
        chunks = [json.loads(line[5:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert chunks[-1]["meta_info"]["output_token_ids_logprobs"] == outputs  # cumulative, as SGLang streams


def test_token_ids_logprob_needs_return_logprob(http):
    r = http.post("/generate", json={"text": "Hi", "token_ids_logprob": [1, 2]})
    assert r.status_code == 400 and "return_logprob" in r.json()["error"]["message"]


# ---------------------------------------------------------------------------- tools without a parser
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather of a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_an_agent_loop_without_a_tool_parser(server):
    """LangChain's bind_tools and LiteLLM send tools without tool_choice (auto), and keep sending
    them on the tool-result turn. This server has no --tool-call-parser and its chat template
    declares no call format: each turn is answered with plain text and no tool_calls."""
    client = server.openai()
    turn = dict(model="tiny_llama", tools=[WEATHER], max_tokens=6, temperature=0)
    first = client.chat.completions.create(messages=ASK, **turn)
    msg = first.choices[0].message
    assert msg.tool_calls is None and isinstance(msg.content, str) and msg.content
    assert first.choices[0].finish_reason == "length"
    streamed = list(client.chat.completions.create(messages=ASK, stream=True, **turn))
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == msg.content and not any(c.choices and c.choices[0].delta.tool_calls for c in streamed)
    # the tool-result turn, as the agent sends it after running the tool itself
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
                         {"id": "call_1", "type": "function",
                          "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    second = client.chat.completions.create(messages=history, tool_choice="auto", **turn)
    assert second.choices[0].message.tool_calls is None and second.choices[0].message.content
    assert server.log().count("no tool-call parser") == 1  # warned once, not per request


# ---------------------------------------------------------------------------- fuzz findings
CHAT = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "Hi", "bootstrap_host": [], "bootstrap_port": [], "bootstrap_room": []}),
    ("/v1/completions", {"prompt": ["Hi", "Yo"], "bootstrap_host": "h", "bootstrap_port": 1, "bootstrap_room": [7]}),
    ("/v1/chat/completions", {"messages": CHAT, "bootstrap_host": "h", "bootstrap_port": 1, "bootstrap_room": []}),
    ("/v1/chat/completions", {"messages": CHAT, "bootstrap_host": ["h", "i"], "bootstrap_port": 1,
                              "bootstrap_room": 7}),
])
def test_short_bootstrap_lists_are_a_400(http, path, body):
    r = http.post(path, json={**body, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("bootstrap_"), r.text


@pytest.mark.parametrize("path,body", [
    ("/generate", lambda t: {"text": t}), ("/v1/completions", lambda t: {"prompt": t}),
    ("/v1/chat/completions", lambda t: {"messages": [{"role": "user", "content": t}]}),
])
def test_a_text_that_cannot_fit_is_refused_from_its_length(http, server, path, body):
    """Refused by its character count alone (the message counts characters, not tokens)."""
    text = "a " * 1_000_000
    r = http.post(path, json=body(text))
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "characters, at least" in message and "context length" in message


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "Hi", "stop": [f"s{i}" for i in range(1000)]}),
    ("/generate", {"text": "Hi", "sampling_params": {"stop": [f"s{i}" for i in range(1000)]}}),
])
def test_too_many_stop_strings_states_the_limit(http, path, body):
    r = http.post(path, json=body)
    assert r.status_code == 400 and "at most 64" in r.json()["error"]["message"], r.text


def test_metrics_under_both_sglang_spellings(http):
    from prometheus_client.parser import text_string_to_metric_families
    assert http.post("/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 2}}).status_code == 200
    fams = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
    assert fams["sglang:spec_accept_length"].samples[0].value == 0.0  # no speculative decoding here
    for name, fam in fams.items():
        if name.startswith("sglang:"):
            twin = fams["sglang_" + name[len("sglang:"):]]
            assert twin.type == fam.type and [s.labels for s in twin.samples] == [s.labels for s in fam.samples]
    assert fams["sglang_num_requests"].samples[0].value >= 1
