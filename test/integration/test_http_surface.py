"""The OpenAI/SGLang surface beyond the basics, against a real `radixlm serve` on the tiny
random Llama: answers the peers' own tests found wrong (logprobs, model info after a weight
update, server version, model cards) and stop_regex, continuous usage, /tokenize and
/detokenize, SGLang-named Prometheus metrics, and function calling."""
from __future__ import annotations

import json
import shutil

import httpx
import pytest

from test.support.server import GREEDY, serving


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    with serving(tiny_llama_dir, str(tmp_path_factory.mktemp("surface") / "server.log"),
                 "--tool-call-parser", "qwen25") as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base, timeout=60.0) as c:
        yield c


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


# ---------------------------------------------------------------------------- peer-found wrong answers
def test_logprobs_zero_gives_the_sampled_token(client):
    out = client.completions.create(model="tiny_llama", prompt="Hello there", max_tokens=3, logprobs=0, **GREEDY)
    lp = out.choices[0].logprobs
    assert len(lp.token_logprobs) == 3 and all(isinstance(x, float) for x in lp.token_logprobs)
    assert lp.top_logprobs == [{tok: x} for tok, x in zip(lp.tokens, lp.token_logprobs)]
    two = client.completions.create(model="tiny_llama", prompt="Hello there", max_tokens=3, logprobs=2,
                                    temperature=1.0, seed=3, extra_body={"ignore_eos": True})
    for tok, x, top in zip(two.choices[0].logprobs.tokens, two.choices[0].logprobs.token_logprobs,
                           two.choices[0].logprobs.top_logprobs):
        assert 2 <= len(top) <= 3 and top[tok] == pytest.approx(x)  # the top 2 plus the sampled token


def test_echo_logprobs_of_a_one_token_prompt(client, http):
    ids = http.post("/tokenize", json={"prompt": "Hello", "add_special_tokens": False}).json()["tokens"]
    assert len(ids) == 1
    out = client.completions.create(model="tiny_llama", prompt="Hello", max_tokens=2, logprobs=1, echo=True,
                                    **GREEDY)
    lp = out.choices[0].logprobs
    assert lp.tokens[0] == "Hello" and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert len(lp.tokens) == 3 and lp.text_offset[:2] == [0, 5]


def test_server_info_version_and_model_card_root(http):
    import radixlm
    assert http.get("/get_server_info").json()["version"] == radixlm.__version__
    card = http.get("/v1/models").json()["data"][0]
    assert card["id"] == card["root"] == "tiny_llama"
    assert http.get("/v1/models/tiny_llama").json()["root"] == "tiny_llama"


def test_update_weights_from_disk_moves_model_info_and_fails_with_success_false(http, tiny_llama_dir, tmp_path):
    bad = http.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "missing")})
    assert bad.status_code == 400
    body = bad.json()
    assert body["success"] is False and body["message"] and body["error"]["code"] == 400
    assert http.get("/get_model_info").json()["model_path"] == tiny_llama_dir
    copy = str(tmp_path / "copy")
    shutil.copytree(tiny_llama_dir, copy)
    ok = http.post("/update_weights_from_disk", json={"model_path": copy, "weight_version": "disk-1"})
    assert ok.status_code == 200 and ok.json()["success"] is True and ok.json()["message"]
    info = http.get("/get_model_info").json()
    assert info["model_path"] == copy and info["weight_version"] == "disk-1"
    assert info["tokenizer_path"] == tiny_llama_dir  # the tokenizer loaded at start stays


# ---------------------------------------------------------------------------- stop_regex
def test_stop_regex_over_openai_and_native(client, http):
    free = client.completions.create(model="tiny_llama", prompt="Count:", max_tokens=24, **GREEDY).choices[0].text
    assert len(free) > 6
    import re
    pattern = re.escape(free[3]) + "(?s:.)"  # that character and whichever follows it
    hit = client.completions.create(model="tiny_llama", prompt="Count:", max_tokens=24, **{
        **GREEDY, "extra_body": {"ignore_eos": True, "stop_regex": pattern}})
    choice = hit.choices[0]
    start = re.search(pattern, free).start()
    assert choice.text == free[:start] and choice.finish_reason == "stop"
    assert choice.model_extra["matched_stop"] == pattern
    native = http.post("/generate", json={"text": "Count:", "sampling_params": {
        "max_new_tokens": 24, "temperature": 0, "ignore_eos": True, "stop_regex": [pattern], "no_stop_trim": True}})
    assert native.json()["text"].startswith(free[:start]) and re.search(pattern, native.json()["text"])
    chunks = list(client.completions.create(model="tiny_llama", prompt="Count:", max_tokens=24, stream=True, **{
        **GREEDY, "extra_body": {"ignore_eos": True, "stop_regex": pattern}}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == free[:start]
    bad = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "stop_regex": "("})
    assert bad.status_code == 400 and "stop_regex" in bad.json()["error"]["message"]


# ---------------------------------------------------------------------------- continuous usage
def test_continuous_usage_stats_in_every_chunk(client):
    chunks = list(client.chat.completions.create(
        model="tiny_llama", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, **GREEDY))
    *body, last = chunks
    assert all(c.usage is not None for c in chunks)
    done = [c.usage.completion_tokens for c in body]
    assert done == sorted(done) and done[0] == 0 and done[-1] == 4
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks)
    assert last.choices == [] and last.usage.completion_tokens == 4  # include_usage's final chunk
    plain = list(client.completions.create(model="tiny_llama", prompt="hi", max_tokens=3, stream=True,
                                           stream_options={"continuous_usage_stats": True}, **GREEDY))
    counts = [c.usage.completion_tokens for c in plain]  # outputs that arrive together share a chunk
    assert counts == sorted(set(counts)) and counts[-1] == 3 and all(c.choices for c in plain)
    without = list(client.completions.create(model="tiny_llama", prompt="hi", max_tokens=3, stream=True, **GREEDY))
    assert all(c.usage is None for c in without)


# ---------------------------------------------------------------------------- tokenize / detokenize
def test_tokenize_and_detokenize(http):
    one = http.post("/tokenize", json={"prompt": "Hello world"}).json()
    assert one["count"] == len(one["tokens"]) == 2 and one["max_model_len"] == 2048
    many = http.post("/v1/tokenize", json={"prompt": ["Hello world", "x"], "return_token_strs": True}).json()
    assert many["tokens"][0] == one["tokens"] and many["count"] == [2, 1] and many["token_strs"][1] == ["x"]
    assert http.post("/detokenize", json={"tokens": one["tokens"]}).json() == {"text": "Hello world"}
    assert http.post("/v1/detokenize", json={"tokens": [one["tokens"], []]}).json() == {"text": ["Hello world", ""]}
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    text = http.post("/detokenize", json={"tokens": chat["tokens"], "skip_special_tokens": False}).json()["text"]
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    usage = httpx.post(http.base_url.join("/v1/chat/completions"), json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}, timeout=60).json()["usage"]
    assert usage["prompt_tokens"] == chat["count"]  # the ids a chat request is given
    for path, body in [("/tokenize", {}), ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}),
                       ("/tokenize", {"prompt": 5}), ("/detokenize", {"tokens": [10 ** 9]}),
                       ("/detokenize", {"tokens": "abc"}), ("/tokenize", {"prompt": "a", "model": "other"})]:
        r = http.post(path, json=body)
        assert r.status_code in (400, 404) and "error" in r.json(), (path, body, r.text)


# ---------------------------------------------------------------------------- SGLang's metric names
SGLANG_METRICS = {  # name -> Prometheus type, as SGLang's collectors declare them
    "sglang:num_running_reqs": "gauge", "sglang:num_queue_reqs": "gauge", "sglang:num_grammar_queue_reqs": "gauge",
    "sglang:num_used_tokens": "gauge", "sglang:token_usage": "gauge", "sglang:max_total_num_tokens": "gauge",
    "sglang:cache_hit_rate": "gauge", "sglang:gen_throughput": "gauge", "sglang:new_token_ratio": "gauge",
    "sglang:prompt_tokens": "counter", "sglang:generation_tokens": "counter", "sglang:cached_tokens": "counter",
    "sglang:num_requests": "counter", "sglang:num_aborted_requests": "counter",
    "sglang:num_retracted_requests": "counter", "sglang:evicted_tokens": "counter",
    "sglang:time_to_first_token_seconds": "histogram", "sglang:inter_token_latency_seconds": "histogram",
    "sglang:time_per_output_token_seconds": "histogram", "sglang:e2e_request_latency_seconds": "histogram",
}


def _families(http):
    from prometheus_client.parser import text_string_to_metric_families
    return {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}


def _value(fam, suffix=""):
    return sum(s.value for s in fam.samples if s.name == fam.name + suffix)


def test_sglang_metric_names_labels_and_types(http, client):
    before = _families(http)
    # streamed: a non-streamed answer arrives at once, so it has no inter-token gaps to observe
    list(client.completions.create(model="tiny_llama", prompt="metrics please", max_tokens=5, stream=True, **GREEDY))
    fams = _families(http)
    for name, kind in SGLANG_METRICS.items():
        assert name in fams and fams[name].type == kind, name
        assert all(s.labels.get("model_name") == "tiny_llama" for s in fams[name].samples), name
    assert "radixlm:num_requests" in fams and "radixlm:time_to_first_token_seconds" in fams  # ours stay

    def grew(n, suffix="_total"):
        return _value(fams[n], suffix) - (_value(before[n], suffix) if n in before else 0)
    assert grew("sglang:num_requests") == 1 and grew("sglang:generation_tokens") == 5
    assert grew("sglang:prompt_tokens") == 2
    assert grew("sglang:e2e_request_latency_seconds", "_count") == 1
    assert grew("sglang:time_to_first_token_seconds", "_count") == 1
    assert grew("sglang:inter_token_latency_seconds", "_count") == 4  # one per token after the first
    assert grew("sglang:time_per_output_token_seconds", "_count") == 1
    assert _value(fams["sglang:num_running_reqs"]) == 0 and 0 <= _value(fams["sglang:token_usage"]) <= 1
    assert _value(fams["sglang:max_total_num_tokens"]) == 8192


# ---------------------------------------------------------------------------- function calling
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
                                  "required": ["a"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _accumulate(chunks):
    """Tool calls rebuilt from streamed deltas as a client does it (by index)."""
    calls, content, finish = {}, "", None
    for c in chunks:
        if not c.choices:
            continue
        ch = c.choices[0]
        content += ch.delta.content or ""
        finish = ch.finish_reason or finish
        for d in ch.delta.tool_calls or []:
            slot = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
            if d.id:
                assert slot["id"] is None, "id sent once"
                slot["id"], slot["name"] = d.id, d.function.name
            slot["arguments"] += d.function.arguments or ""
    return calls, content, finish


def test_tool_choice_required_gives_valid_calls(client):
    out = client.chat.completions.create(model="tiny_llama", messages=ASK, tools=[WEATHER, ADD], tool_choice="required",
                                         parallel_tool_calls=False, max_tokens=60, temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in ("get_weather", "add")
    args = json.loads(call.function.arguments)
    assert set(args) == ({"city", "days"} if call.function.name == "get_weather" else {"a"})
    streamed = list(client.chat.completions.create(
        model="tiny_llama", messages=ASK, tools=[WEATHER, ADD], tool_choice="required", parallel_tool_calls=False,
        max_tokens=60, temperature=0, stream=True))
    calls, content, finish = _accumulate(streamed)
    assert finish == "tool_calls" and not content
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [(call.function.name, call.function.arguments)]
    assert sum(1 for c in streamed if c.choices and c.choices[0].delta.tool_calls) > 3  # arguments came in pieces


def test_named_tool_choice_and_parallel_calls(client):
    out = client.chat.completions.create(model="tiny_llama", messages=ASK, tools=[WEATHER, ADD],
                                         tool_choice={"type": "function", "function": {"name": "add"}},
                                         max_tokens=40, temperature=0)
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "add" and 0 <= json.loads(call.function.arguments)["a"] <= 9
    many = client.chat.completions.create(model="tiny_llama", messages=ASK, tools=[ADD], tool_choice="required",
                                          max_tokens=200, temperature=1.0, seed=5)
    calls = many.choices[0].message.tool_calls
    assert calls and all(c.function.name == "add" for c in calls) and len({c.id for c in calls}) == len(calls)


def test_tool_choice_auto_reads_the_models_calls(client):
    """The tiny model's weights are random, so a regex makes it write a Qwen2.5/Hermes call:
    the parser (--tool-call-parser qwen25) must turn it into message.tool_calls."""
    regex = r'Sure\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Rome", "days": 3\}\}\n</tool_call>'
    kw = dict(model="tiny_llama", messages=ASK, tools=[WEATHER, ADD], max_tokens=60, temperature=0,
              extra_body={"regex": regex})
    out = client.chat.completions.create(**kw)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Rome", "days": 3}
    calls, content, finish = _accumulate(client.chat.completions.create(**kw, stream=True))
    assert finish == "tool_calls" and content.strip() == "Sure."
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("get_weather", {"city": "Rome", "days": 3})]
    plain = client.chat.completions.create(model="tiny_llama", messages=ASK, tools=[WEATHER], max_tokens=5,
                                           temperature=0, extra_body={"ignore_eos": True})
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason == "length"
    assert plain.choices[0].message.content


def test_tool_choice_none_and_tool_turns(client):
    out = client.chat.completions.create(model="tiny_llama", tools=[WEATHER], tool_choice="none", max_tokens=6,
                                         temperature=0, messages=ASK + [
                                             {"role": "assistant", "content": None, "tool_calls": [
                                                 {"id": "call_1", "type": "function", "function": {
                                                     "name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
                                             {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}])
    assert out.choices[0].message.tool_calls is None and out.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("body,param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]}, None),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, None),
])
def test_bad_tool_requests_are_400(http, body, param):
    r = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    if param:
        assert r.json()["error"]["param"] == param


# ---------------------------------------------------------------------------- --skip-tokenizer-init
@pytest.fixture(scope="module")
def bare(tiny_llama_dir, tmp_path_factory):
    """A server that loads no tokenizer: ids in, ids out (RL callers)."""
    with serving(tiny_llama_dir, str(tmp_path_factory.mktemp("bare") / "server.log"), "--skip-tokenizer-init") as srv:
        with httpx.Client(base_url=srv.base, timeout=60.0) as c:
            yield c


def test_skip_tokenizer_init_ids_in_ids_out(bare, http):
    body = {"input_ids": [1, 5, 9, 100], "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True},
            "return_logprob": True}
    out = bare.post("/generate", json=body).json()
    assert "text" not in out and len(out["output_ids"]) == 5
    assert [t for _, t, _ in out["meta_info"]["output_token_logprobs"]] == out["output_ids"]
    ref = http.post("/generate", json=body).json()  # the same weights with a tokenizer
    assert ref["output_ids"] == out["output_ids"]
    events = [json.loads(line[6:]) for line in bare.post("/generate", json={**body, "stream": True}).text.splitlines()
              if line.startswith("data: {")]
    assert events[-1]["output_ids"] == out["output_ids"] and all("text" not in e for e in events)
    batch = bare.post("/generate", json={**body, "input_ids": [[1, 2], [3, 4, 5]]}).json()
    assert [len(b["output_ids"]) for b in batch] == [5, 5]


@pytest.mark.parametrize("path,body", [
    ("/generate", {"text": "hello", "sampling_params": {"max_new_tokens": 2}}),
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2, "stop": ["x"]}}),
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2, "stop_regex": "x"}}),
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2, "regex": "a+"}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/completions", {"prompt": [1, 2, 3]}),
    ("/tokenize", {"prompt": "hi"}),
    ("/detokenize", {"tokens": [1, 2]}),
])
def test_skip_tokenizer_init_refuses_what_needs_text(bare, path, body):
    r = bare.post(path, json=body)
    assert r.status_code == 400 and r.json()["error"]["message"], r.text
    assert bare.get("/health_generate").status_code == 200
