"""The HTTP server end to end: a real `radixlm serve` subprocess on a tiny random Llama
(test/support/server.py), driven with httpx and the official openai client (OpenAI API, native
API, errors, metrics, SIGTERM)."""
from __future__ import annotations

import os
import threading
import time

import httpx
import openai
import pytest

from test.support.server import GREEDY, serving, sse_events


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    with serving(tiny_llama_dir, str(tmp_path_factory.mktemp("http") / "server.log")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base, timeout=60.0) as c:
        yield c


# ---------------------------------------------------------------------------- info endpoints
def test_models_health_and_model_info(server, client, http):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny_llama"]
    # the model path (and its basename) name the same model
    path = http.get("/get_model_info").json()["model_path"].rstrip("/")
    for name in (path, os.path.basename(path)):
        assert http.post("/v1/completions", json={"model": name, "prompt": "x", "max_tokens": 1}).status_code == 200
    assert http.get("/health").status_code == 200
    assert http.get("/health_generate").status_code == 200
    info = http.get("/get_model_info").json()
    assert info["is_generation"] is True and info["context_length"] == 2048 and info["vocab_size"] == 49152
    assert info["tokenizer_path"] == info["model_path"]
    assert http.get(f"/v1/models/{models.data[0].id}").status_code == 200
    assert http.get("/v1/models/nope").status_code == 404
    sinfo = server.info()
    assert sinfo["server_args"]["max_total_tokens"] == 8192 and sinfo["memory"]["capacity"] == 8192


# ---------------------------------------------------------------------------- OpenAI API
def test_chat_non_stream_and_stream_agree(client):
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Again?"}]
    full = client.chat.completions.create(model="tiny_llama", messages=msgs, max_tokens=12, **GREEDY)
    choice = full.choices[0]
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    assert full.usage.completion_tokens == 12 and full.usage.prompt_tokens > 10
    assert full.usage.total_tokens == full.usage.prompt_tokens + 12
    chunks = list(client.chat.completions.create(model="tiny_llama", messages=msgs, max_tokens=12, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_max_completion_tokens_and_content_parts(client):
    out = client.chat.completions.create(
        model="tiny_llama", messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
        max_completion_tokens=3, **GREEDY)
    assert out.usage.completion_tokens == 3


@pytest.mark.parametrize("prompt", ["Once upon a time", ["Once upon a time", "The capital of France"],
                                    [1, 5, 9, 100, 2000], [[1, 5, 9], [300, 301, 302, 303]]])
def test_completions_prompt_forms(client, prompt):
    out = client.completions.create(model="tiny_llama", prompt=prompt, max_tokens=5, **GREEDY)
    n_prompts = len(prompt) if isinstance(prompt, list) and not isinstance(prompt[0], int) else 1
    assert [c.index for c in out.choices] == list(range(n_prompts))
    assert all(c.finish_reason == "length" for c in out.choices)
    assert out.usage.completion_tokens == 5 * n_prompts
    stream = list(client.completions.create(model="tiny_llama", prompt=prompt, max_tokens=5, stream=True,
                                            **GREEDY))
    for c in out.choices:
        assert "".join(s.choices[0].text for s in stream if s.choices[0].index == c.index) == c.text


def test_completions_default_max_tokens_is_16(client):
    out = client.completions.create(model="tiny_llama", prompt="Hello", **GREEDY)
    assert out.usage.completion_tokens == 16


def test_n_choices(client):
    out = client.completions.create(model="tiny_llama", prompt="Tell me", max_tokens=6, n=3, temperature=1.0,
                                    seed=7, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert len({c.text for c in out.choices}) > 1
    assert out.usage.completion_tokens == 18
    chat = list(client.chat.completions.create(model="tiny_llama", messages=[{"role": "user", "content": "x"}],
                                               max_tokens=4, n=2, stream=True, temperature=1.0,
                                               extra_body={"ignore_eos": True}))
    done = {c.choices[0].index: c.choices[0].finish_reason for c in chat if c.choices[0].finish_reason}
    assert done == {0: "length", 1: "length"}


def test_chat_logprobs(client):
    out = client.chat.completions.create(model="tiny_llama", messages=[{"role": "user", "content": "Hi"}],
                                         max_tokens=5, logprobs=True, top_logprobs=3, **GREEDY)
    content = out.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-5)  # greedy: the argmax
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= entry.top_logprobs[2].logprob
        assert isinstance(entry.bytes, list)
    assert bytes(b for e in content for b in e.bytes).decode("utf-8", "replace") == out.choices[0].message.content
    stream = list(client.chat.completions.create(model="tiny_llama", messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=5, logprobs=True, top_logprobs=1, stream=True, **GREEDY))
    streamed = [e for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-5)


def test_completion_logprobs_and_echo(client):
    out = client.completions.create(model="tiny_llama", prompt="The quick brown fox", max_tokens=4, logprobs=2,
                                    **GREEDY)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert all(len(t) == 2 for t in lp.top_logprobs) and lp.text_offset[0] == 0
    assert lp.text_offset == sorted(lp.text_offset)
    echo = client.completions.create(model="tiny_llama", prompt="The quick brown fox", max_tokens=4, logprobs=1,
                                     echo=True, **GREEDY)
    assert echo.choices[0].text == "The quick brown fox" + out.choices[0].text
    elp = echo.choices[0].logprobs
    assert elp.token_logprobs[0] is None and len(elp.tokens) == 4 + 4  # 4 prompt tokens + 4 generated
    assert elp.text_offset[4] == len("The quick brown fox")


def test_cached_tokens_on_repeated_long_prompt(client, http):
    assert http.post("/flush_cache").status_code == 200
    long_text = " ".join(f"word{i}" for i in range(200))
    msgs = [{"role": "user", "content": long_text}]
    first = client.chat.completions.create(model="tiny_llama", messages=msgs, max_tokens=2, **GREEDY)
    second = client.chat.completions.create(model="tiny_llama", messages=msgs, max_tokens=2, **GREEDY)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1 > 200


# ---------------------------------------------------------------------------- native API
def test_generate_stream_is_cumulative_and_matches_non_stream(http):
    # long enough that the stream cannot be coalesced into one chunk: the tiny model makes 10 tokens in
    # ~8 ms, which a loaded machine may deliver as one
    body = {"text": "In a hole in the ground", "sampling_params": {"max_new_tokens": 300, "temperature": 0,
                                                                    "ignore_eos": True}}
    full = http.post("/generate", json=body).json()
    assert len(full["output_ids"]) == 300 and full["meta_info"]["finish_reason"]["type"] == "length"
    with http.stream("POST", "/generate", json={**body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) > 1
    for a, b in zip(chunks, chunks[1:]):
        assert b["text"].startswith(a["text"]) and b["output_ids"][:len(a["output_ids"])] == a["output_ids"]
    assert chunks[-1]["text"] == full["text"] and chunks[-1]["output_ids"] == full["output_ids"]
    batch = http.post("/generate", json={"input_ids": [[1, 2, 3], [4, 5]],
                                         "sampling_params": {"max_new_tokens": 2}}).json()
    assert isinstance(batch, list) and len(batch) == 2


BAD_REQUESTS = [
    ("/v1/chat/completions", b"{not json"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 3'),
    ("/v1/chat/completions", {"model": "tiny_llama", "messages": "hello"}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}),
    ("/v1/completions", {"prompt": "hi", "top_p": 2}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}),
    ("/v1/completions", {"prompt": "hi", "n": 0}),
    ("/v1/completions", {"prompt": ""}),
    ("/v1/completions", {"prompt": [1, 2, 10 ** 9]}),
    ("/v1/completions", {"prompt": list(range(3000))}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 5000}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 3000}]}),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}),
    ("/generate", {"text": "hi", "sampling_params": {"temprature": 0.5}}),
    ("/generate", {"text": "hi", "input_ids": [1, 2]}),
    ("/generate", {"text": "hi", "stream_it": True}),
    ("/generate", {"input_ids": list(range(3000)), "stream": True}),
]


@pytest.mark.parametrize("path,body", BAD_REQUESTS)
def test_bad_requests_are_400_and_server_keeps_serving(http, path, body):
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "BadRequestError" and err["code"] == 400 and err["message"]
    assert set(err) == {"message", "type", "param", "code"}
    ok = http.post("/v1/completions", json={"prompt": "ok", "max_tokens": 2})
    assert ok.status_code == 200


def test_unknown_model_is_404(client, http):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-7", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    r = http.post("/v1/completions", json={"model": "gpt-7", "prompt": "hi", "stream": True})
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny_llama", prompt="hi", top_p=2)


def test_timeout_is_503(http):
    body = {"text": "slow", "sampling_params": {"max_new_tokens": 1900, "ignore_eos": True}, "timeout": 0.2}
    r = http.post("/generate", json=body)
    assert r.status_code == 503 and r.json()["error"]["type"] == "ServiceUnavailableError"
    r = http.post("/v1/completions", json={"prompt": "slow", "max_tokens": 1900, "ignore_eos": True, "timeout": 0.2})
    assert r.status_code == 503 and r.json()["error"]["code"] == 503
    with http.stream("POST", "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                           "max_tokens": 1900, "ignore_eos": True, "timeout": 0.2,
                                                           "stream": True}) as r:
        if r.status_code == 503:  # timed out before its first token: a plain error
            return
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == 503


# ---------------------------------------------------------------------------- control
def test_metrics(http):
    http.post("/v1/completions", json={"prompt": "metrics", "max_tokens": 3})
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
    for name in ("radixlm:num_requests_total", "radixlm:generation_tokens_total",
                 "radixlm:time_to_first_token_seconds_bucket", "radixlm:e2e_request_latency_seconds_count",
                 "radixlm:num_running_reqs", "radixlm:token_usage"):
        assert name in r.text, name


def test_flush_cache_when_idle(http):
    for method in (http.get, http.post):
        r = method("/flush_cache")
        assert r.status_code == 200 and "flushed" in r.text.lower()


def test_abort_request_ends_a_stream_with_abort(http):
    body = {"text": "abort me", "rid": "abort-me", "stream": True,
            "sampling_params": {"max_new_tokens": 1900, "ignore_eos": True}}
    events = []
    with http.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            events += sse_events([line])
            if len(events) == 2:
                assert http.post("/abort_request", json={"rid": "abort-me"}).status_code == 200
    assert events[-1] == "[DONE]"
    fr = events[-2]["meta_info"]["finish_reason"]
    assert fr["type"] == "abort" and len(events[-2]["output_ids"]) < 1900
    assert http.post("/abort_request", json={"abort_all": True}).status_code == 200
    metrics = http.get("/metrics").text
    count = [line for line in metrics.splitlines() if line.startswith("radixlm:cancel_latency_seconds_count")]
    assert count and float(count[0].split()[-1]) >= 1  # abort call -> KV returned, as a histogram
    assert 'radixlm:aborts{place="running"}' in metrics


def test_rl_endpoints(http):
    """Weight update over HTTP (serialized tensors), version, reads, memory hand-back."""
    import torch

    from radixlm.srt.weight_serialization import serialize_named_tensors
    name = "model.layers.0.mlp.down_proj.weight"
    before = http.post("/get_weights_by_name", json={"name": name, "truncate_size": 2}).json()
    v0 = http.get("/get_weight_version").json()["weight_version"]
    new = torch.tensor(http.post("/get_weights_by_name", json={"name": name, "truncate_size": 10**6}).json()) + 0.5
    r = http.post("/update_weights_from_tensor", json={
        "serialized_named_tensors": serialize_named_tensors([(name, new)]), "weight_version": "rl-1"})
    assert r.status_code == 200 and r.json()["weight_version"] == "rl-1" != v0
    after = http.post("/get_weights_by_name", json={"name": name, "truncate_size": 2}).json()
    assert torch.allclose(torch.tensor(after), torch.tensor(before) + 0.5)
    out = http.post("/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}).json()
    assert out["meta_info"]["weight_version"] == "rl-1"
    bad = http.post("/update_weights_from_tensor", json={
        "serialized_named_tensors": serialize_named_tensors([(name, torch.zeros(3))])})
    assert bad.status_code == 400 and "shape mismatch" in bad.json()["error"]["message"]
    assert http.post("/update_weights_from_tensor", json={"serialized_named_tensors": "!!"}).status_code == 400
    bad_path = http.post("/update_weights_from_disk", json={"model_path": "/nonexistent"})
    # no key configured, so nobody is authenticated: no file-system oracle
    assert bad_path.status_code == 400 and "nonexistent" not in bad_path.text and "exist" not in bad_path.text
    assert http.post("/release_memory_occupation").status_code == 200
    refused = http.post("/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}})
    assert refused.status_code == 400 and "release" in refused.json()["error"]["message"]
    assert http.post("/resume_memory_occupation").status_code == 200
    ok = http.post("/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}})
    assert ok.status_code == 200
    assert http.post("/update_weight_version", json={"new_version": "rl-2"}).status_code == 200
    assert http.get("/get_weight_version").json()["weight_version"] == "rl-2"



def test_structured_output_over_openai(client):
    import json
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["a"], "additionalProperties": False}
    r = client.chat.completions.create(
        model="tiny_llama", messages=[{"role": "user", "content": "json please"}], max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": schema}})
    obj = json.loads(r.choices[0].message.content)
    assert set(obj) == {"a"} and 0 <= obj["a"] <= 9
    c = client.completions.create(model="tiny_llama", prompt="Answer:", max_tokens=10, temperature=0,
                                  extra_body={"regex": "(yes|no)"})
    assert c.choices[0].text in ("yes", "no")
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny_llama", messages=[{"role": "user", "content": "x"}],
                                       max_tokens=5, response_format={"type": "xml"})

def test_sigterm_stops_everything(server):
    """Last test of the module: SIGTERM during a streaming request."""
    results: dict = {}

    def stream() -> None:
        try:
            with httpx.stream("POST", server.base + "/generate", timeout=30.0,
                              json={"text": "x", "stream": True,
                                    "sampling_params": {"max_new_tokens": 1900, "ignore_eos": True}}) as r:
                results["events"] = sse_events(r.iter_lines())
        except httpx.HTTPError as e:
            results["error"] = e

    t = threading.Thread(target=stream)
    t.start()
    deadline = time.monotonic() + 10
    while server.info()["num_running_reqs"] == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    rc, elapsed = server.stop()
    t.join(10)
    assert rc == 0 and elapsed < 8.0, (rc, elapsed, server.log())
    if "events" in results:  # the stream was ended by the shutdown's abort, not cut
        assert results["events"][-1] == "[DONE]"

