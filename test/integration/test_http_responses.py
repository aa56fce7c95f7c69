"""/v1/responses with the official `openai` client against a real `radixlm serve` on the tiny
random Llama: plain and streamed (the event sequence the client parses), instructions and
message items, stored responses and previous_response_id, json_schema output, function tools
and their results, cancel through the normal stop path."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from test.support.server import serving

EXTRA = {"extra_body": {"ignore_eos": True}}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                          "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    with serving(tiny_llama_dir, str(tmp_path_factory.mktemp("responses") / "server.log"),
                 "--max-stored-responses", "8") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


def test_plain_and_streamed_agree(client):
    kw = dict(model="tiny_llama", input="Tell me a story.", max_output_tokens=6, temperature=0, **EXTRA)
    r = client.responses.create(**kw)
    assert r.object == "response" and r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text and r.usage.output_tokens == 6 and r.usage.total_tokens == r.usage.input_tokens + 6
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == r.output_text == events[-1].response.output_text
    assert events[0].response.status == "in_progress" and events[-1].response.usage.output_tokens == 6


def test_instructions_items_store_and_previous_response(client):
    first = client.responses.create(model="tiny_llama", instructions="You are terse.", max_output_tokens=4,
                                    temperature=0, input=[{"role": "user", "content": [
                                        {"type": "input_text", "text": "Name a colour."}]}], **EXTRA)
    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text and got.instructions == "You are terse."
    second = client.responses.create(model="tiny_llama", input="Another one?", previous_response_id=first.id,
                                     max_output_tokens=3, temperature=0, **EXTRA)
    assert second.previous_response_id == first.id
    # the earlier turn and its answer came first: a longer prompt, whose start is cached
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens - 8
    assert second.usage.input_tokens_details.cached_tokens > 0
    unstored = client.responses.create(model="tiny_llama", input="Hi", max_output_tokens=2, store=False, **EXTRA)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="tiny_llama", input="Hi", previous_response_id="resp_unknown")
    assert client.responses.delete(first.id) is None
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)


def test_json_schema_output(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    r = client.responses.create(model="tiny_llama", input="Answer in JSON.", max_output_tokens=40, temperature=0,
                                text={"format": {"type": "json_schema", "name": "answer", "schema": schema,
                                                 "strict": True}})
    assert isinstance(json.loads(r.output_text)["ok"], bool) and r.text.format.type == "json_schema"


def test_function_tools_and_their_results(client):
    r = client.responses.create(model="tiny_llama", input="Weather in Paris?", tools=[WEATHER],
                                tool_choice="required", max_output_tokens=60, temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and json.loads(calls[0].arguments)["city"] in ("Paris", "Rome")
    assert r.status == "completed"
    events = list(client.responses.create(model="tiny_llama", input="Weather in Paris?", tools=[WEATHER],
                                          tool_choice="required", max_output_tokens=60, temperature=0, stream=True))
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done and args == done[0].arguments == calls[0].arguments and events[-1].type == "response.completed"
    follow = client.responses.create(model="tiny_llama", previous_response_id=r.id, tools=[WEATHER],
                                     max_output_tokens=4, temperature=0, **EXTRA, input=[
                                         {"type": "function_call_output", "call_id": calls[0].call_id,
                                          "output": "sunny"}])
    assert follow.output_text and not [o for o in follow.output if o.type == "function_call"]


def test_cancel_stops_a_running_response(server, client):
    body = {"model": "tiny_llama", "input": "Go on forever.", "max_output_tokens": 1500, "stream": True,
            "ignore_eos": True}
    with httpx.Client(base_url=server.base, timeout=60.0) as http, \
            http.stream("POST", "/v1/responses", json=body) as s:
        lines = s.iter_lines()
        created = None
        for line in lines:
            if line.startswith("data: "):
                event = json.loads(line[6:])
                if event["type"] == "response.created":
                    created = event["response"]["id"]
                if event["type"] == "response.output_text.delta":
                    break
        cancelled = client.responses.cancel(created)
        assert cancelled.status == "cancelled"
        rest = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert rest[-1]["type"] == "response.incomplete" and rest[-1]["response"]["status"] == "cancelled"
    assert rest[-1]["response"]["usage"]["output_tokens"] < 1500
    assert client.responses.retrieve(created).status == "cancelled"


@pytest.mark.parametrize("body,param", [
    ({"input": []}, "input"), ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": "x", "reasoning": {"effort": "low"}}, "reasoning"), ({"input": "x", "background": True}, "background"),
    ({"input": [{"type": "file_search_call"}]}, "input[0].type"), ({"input": "x", "max_output_tokens": -1}, None),
])
def test_bad_requests_are_400(server, body, param):
    r = httpx.post(server.base + "/v1/responses", json={"model": "tiny_llama", **body}, timeout=60.0)
    assert r.status_code == 400, r.text
    if param:
        assert r.json()["error"]["param"] == param
