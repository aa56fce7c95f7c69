"""Tool-call parsers on fixed texts: the whole-output parse, and the same text streamed in
every chunking (one character at a time, and random cuts) giving the same calls."""
from __future__ import annotations

import json
import random

import pytest

from radixlm.srt.function_call.formats import FORCED, LLAMA3, MISTRAL, QWEN25, select_format
from radixlm.srt.function_call.json_scan import object_members, value_end
from radixlm.srt.function_call.stream import CallArgs, CallEnd, CallStart, Text, ToolCallStream

TOOLS = {"get_weather", "add"}

CASES = [
    # (format, text, expected content, expected [(name, arguments)])
    (QWEN25, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     None, [("get_weather", '{"city": "Paris"}')]),
    (QWEN25, 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": [2, {"c": "}"}]}}\n</tool_call>',
     "Let me check.", [("get_weather", '{"city": "Rome"}'), ("add", '{"a": 1, "b": [2, {"c": "}"}]}')]),
    (QWEN25, "No tools needed: 2 < 3 and <tool is not a tag.", "No tools needed: 2 < 3 and <tool is not a tag.", []),
    (QWEN25, '<tool_call>{"name": "unknown_fn", "arguments": {}}</tool_call> ok',
     '<tool_call>{"name": "unknown_fn", "arguments": {}}</tool_call> ok', []),
    (QWEN25, '<tool_call>\n{"arguments": {"a": 2}, "name": "add"}\n</tool_call>', None, [("add", '{"a": 2}')]),
    (QWEN25, '<tool_call>{"name": "add"}</tool_call>', None, [("add", "{}")]),
    # Qwen3 (hermes): an empty thinking block first, arguments spread over lines
    (QWEN25, '<think>\n\n</think>\n\n<tool_call>\n{"name": "get_weather",\n "arguments": {"city": "Lima"}}\n'
             '</tool_call>', "<think>\n\n</think>", [("get_weather", '{"city": "Lima"}')]),
    (LLAMA3, '{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [("get_weather", '{"city": "Paris"}')]),
    (LLAMA3, '<|python_tag|>{"name": "add", "parameters": {"a": 1}}; {"name": "add", "parameters": {"a": 2}}',
     None, [("add", '{"a": 1}'), ("add", '{"a": 2}')]),
    (LLAMA3, '{"answer": 42} is JSON but not a call', '{"answer": 42} is JSON but not a call', []),
    (LLAMA3, "The weather is fine.", "The weather is fine.", []),
    (MISTRAL, '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}}, {"name": "get_weather", "arguments": {"city": "Oslo"}}]',
     None, [("add", '{"a": 1}'), ("get_weather", '{"city": "Oslo"}')]),
    (MISTRAL, ' [{"name": "add", "arguments": {"a": 3}}]', None, [("add", '{"a": 3}')]),  # the special token skipped
    (MISTRAL, "[1, 2] is a list", "[1, 2] is a list", []),
    (FORCED, '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "add", "parameters": {"a": 5}}]',
     None, [("get_weather", '{"city": "Paris"}'), ("add", '{"a": 5}')]),
]


def _collect(events):
    content, calls, ids = "", {}, {}
    for e in events:
        if isinstance(e, Text):
            content += e.text
        elif isinstance(e, CallStart):
            assert e.index not in calls and e.index == len(calls), "calls start in index order, once"
            calls[e.index] = [e.name, "", False]
            ids[e.index] = e.id
        elif isinstance(e, CallArgs):
            assert not calls[e.index][2], "no arguments after the call ended"
            calls[e.index][1] += e.fragment
        elif isinstance(e, CallEnd):
            calls[e.index][2] = e.complete
    return content, [(n, a) for n, a, done in calls.values() if done], ids


@pytest.mark.parametrize("fmt,text,content,calls", CASES)
def test_whole_output(fmt, text, content, calls):
    res = ToolCallStream(fmt, TOOLS).parse(text)
    assert res.content == content
    assert [(c.name, c.arguments) for c in res.calls] == calls
    for c in res.calls:
        json.loads(c.arguments)
        assert c.id.startswith("call_")


@pytest.mark.parametrize("seed", [None, 1, 2, 3])
@pytest.mark.parametrize("fmt,text,content,calls", CASES)
def test_streamed_in_any_chunking_equals_whole(fmt, text, content, calls, seed):
    rng = random.Random(seed)
    cuts = list(range(1, len(text))) if seed is None else sorted(rng.sample(range(1, len(text)), min(5, len(text) - 1)))
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    stream = ToolCallStream(fmt, TOOLS)
    events = []
    for i, p in enumerate(pieces):
        events += stream.feed(p, final=i == len(pieces) - 1)
    got_content, got_calls, _ = _collect(events)
    assert got_calls == calls
    assert (got_content.strip() or None) == content


def test_arguments_arrive_incrementally():
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris, France"}}</tool_call>'
    stream = ToolCallStream(QWEN25, TOOLS)
    arg_events = [e for ch in text for e in stream.feed(ch) if isinstance(e, CallArgs)]
    assert len(arg_events) > 5 and "".join(e.fragment for e in arg_events) == '{"city": "Paris, France"}'


def test_no_text_leaks_before_a_marker_is_decided():
    stream = ToolCallStream(QWEN25, TOOLS)
    assert _collect(stream.feed("Hi <tool_"))[0] == "Hi "
    assert _collect(stream.feed("call>"))[0] == ""
    _, calls, _ = _collect(stream.feed('{"name": "add", "arguments": {}}</tool_call>', final=True))
    assert calls == [("add", "{}")]


def test_cut_off_call_stays_in_content_and_is_not_a_call():
    text = 'Sure <tool_call>{"name": "add", "arguments": {"a": 1'
    res = ToolCallStream(QWEN25, TOOLS).parse(text)
    assert res.calls == [] and res.content == text
    events = ToolCallStream(QWEN25, TOOLS).feed(text, final=True)
    assert any(isinstance(e, CallEnd) and not e.complete for e in events)


def test_any_name_when_no_tool_list():
    res = ToolCallStream(QWEN25, None).parse('<tool_call>{"name": "whatever", "arguments": {}}</tool_call>')
    assert [c.name for c in res.calls] == ["whatever"]


def test_json_scan():
    assert value_end('{"a": [1, "]"], "b": null} tail', 0) == 26
    assert value_end('{"a": [1, "]"', 0) is None
    assert value_end("12", 0) is None and value_end("12,", 0) == 2 and value_end("tr", 0) is None
    with pytest.raises(ValueError):
        value_end("{a: 1}", 0)
    scan = object_members('{"name": "f", "arguments": {"x": "y', 0)
    assert scan.end is None and scan.get("name").value_end == 12 and scan.get("arguments").value_end is None


def test_format_selection():
    assert select_format("qwen25", None) is QWEN25 and select_format("hermes", None) is QWEN25
    assert select_format(None, "{% if tools %}<tool_call>{% endif %}") is QWEN25
    assert select_format(None, "... [TOOL_CALLS] ...") is MISTRAL
    assert select_format(None, "<|python_tag|>") is LLAMA3
    assert select_format(None, "<|im_start|>{{ message['content'] }}") is None
    with pytest.raises(ValueError):
        select_format("nope", None)
