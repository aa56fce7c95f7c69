"""/v1/responses' pure pieces: input items as chat messages, a response's output as the turn a
follow-up continues, the chat request a Responses request amounts to, and the LRU store."""
from __future__ import annotations

import pytest

from radixlm.srt.http_utils import HTTPError
from radixlm.srt.openai_responses import ResponseStore, StoredResponse
from radixlm.srt.responses_protocol import (ResponsesRequest, chat_request, function_call_item, input_messages,
                                            message_item, output_messages)


def test_input_items_become_chat_messages():
    assert input_messages("hi") == [{"role": "user", "content": "hi"}]
    items = [{"role": "developer", "content": "be brief"},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                              {"type": "input_text", "text": "b"}]},
             {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
             {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{\"x\": 1}"},
             {"type": "function_call_output", "call_id": "c1", "output": "42"}]
    msgs = input_messages(items)
    assert msgs[0] == {"role": "system", "content": "be brief"} and msgs[1]["content"] == "ab"
    assert [c["id"] for c in msgs[2]["tool_calls"]] == ["c1", "c2"]  # parallel calls: one assistant turn
    assert msgs[3] == {"role": "tool", "tool_call_id": "c1", "content": "42"}
    for bad in ([], [{"role": "robot", "content": "x"}], [{"type": "function_call", "name": "f"}],
                [{"role": "user", "content": [{"type": "input_image"}]}]):
        with pytest.raises(HTTPError):
            input_messages(bad)


def test_output_becomes_the_next_turn():
    output = [message_item("m", "Let me check.", "completed"), function_call_item("f", "c1", "get", "{}", "completed")]
    (turn,) = output_messages(output)
    assert turn["content"] == "Let me check." and turn["tool_calls"][0]["function"] == {"name": "get",
                                                                                        "arguments": "{}"}


def test_chat_request_of_a_responses_request():
    req = ResponsesRequest.model_validate({
        "input": "x", "instructions": "sys", "max_output_tokens": 7, "top_k": 3,
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        "tool_choice": {"type": "function", "name": "f"},
        "text": {"format": {"type": "json_schema", "name": "o", "schema": {"type": "object"}}}})
    chat = chat_request(req, input_messages(req.input), "resp_1")
    assert [m.role for m in chat.messages] == ["system", "user"] and chat.max_completion_tokens == 7
    assert chat.rid == "resp_1" and chat.top_k == 3 and chat.tools[0].function.name == "f"
    assert chat.tool_choice.function.name == "f" and chat.response_format["json_schema"]["name"] == "o"


def test_store_drops_the_least_recently_used():
    store = ResponseStore(2)
    req = ResponsesRequest.model_validate({"input": "x"})
    for i in range(3):
        store.put(f"r{i}", StoredResponse(req, [], {"id": f"r{i}"}))
        if i == 1:
            assert store.get("r0") is not None  # r0 used: r1 is now the oldest
    assert store.get("r1") is None and store.get("r0") is not None and store.get("r2") is not None
    assert len(store) == 2
