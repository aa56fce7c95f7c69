"""tool_choice planning (validation, the forcing grammar) and the chat prompt with tools:
the tools reach the chat template, earlier calls are rendered with object arguments."""
from __future__ import annotations

import asyncio
import copy
import json
from types import SimpleNamespace

import pytest

from radixlm.srt.function_call.formats import FORCED, QWEN25
from radixlm.srt.function_call.tool_choice import ToolChoiceError, calls_schema, plan_tools
from radixlm.srt.openai_protocol import ChatCompletionRequest

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}},
         {"type": "function", "function": {"name": "ping"}}]

# A Hermes/Qwen2.5-style template: tools in the system turn, earlier calls as <tool_call> JSON.
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "Answer with <tool_call>{...}</tool_call>.<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "<tool_call>{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}</tool_call>"
    "{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def req(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **kw)


def plan(fmt=QWEN25, **kw):
    r = req(**kw)
    return plan_tools(r.tools, r.tool_choice, r.parallel_tool_calls, fmt)


def test_no_tools():
    p = plan()
    assert p.template_tools is None and p.json_schema is None and p.fmt is None
    for choice in ("required", {"type": "function", "function": {"name": "x"}}):
        with pytest.raises(ToolChoiceError):
            plan(tool_choice=choice)


def test_auto_is_the_default_with_tools_and_plain_text_without_a_parser():
    p = plan(tools=TOOLS)
    assert p.fmt is QWEN25 and p.json_schema is None and len(p.template_tools) == 2
    assert p.tool_names == {"get_weather", "ping"} and not p.unparsed
    for choice in (None, "auto"):  # as SGLang answers: the tools are rendered, the output is content
        p = plan(fmt=None, tools=TOOLS, tool_choice=choice)
        assert p.unparsed and p.fmt is None and p.json_schema is None and len(p.template_tools) == 2


def test_none_renders_no_tools_and_reads_no_calls():
    p = plan(fmt=None, tools=TOOLS, tool_choice="none")
    assert p.template_tools is None and p.fmt is None and p.json_schema is None


def test_required_and_named_force_a_grammar():
    p = plan(fmt=None, tools=TOOLS, tool_choice="required")
    schema = json.loads(p.json_schema)
    assert p.fmt is FORCED and schema["minItems"] == 1 and "maxItems" not in schema
    assert [i["properties"]["name"]["enum"] for i in schema["items"]["anyOf"]] == [["get_weather"], ["ping"]]
    one = json.loads(plan(fmt=None, tools=TOOLS, tool_choice="required", parallel_tool_calls=False).json_schema)
    assert one["maxItems"] == 1
    named = json.loads(plan(fmt=None, tools=TOOLS, tool_choice={"type": "function",
                                                                 "function": {"name": "ping"}}).json_schema)
    assert named["maxItems"] == 1 and named["items"]["properties"]["name"]["enum"] == ["ping"]
    assert named["items"]["properties"]["parameters"] == {"type": "object", "properties": {}}
    with pytest.raises(ToolChoiceError, match="not in tools"):
        plan(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})


def test_forced_schema_accepts_what_the_parser_reads():
    import jsonschema
    r = req(tools=TOOLS)
    schema = calls_schema(r.tools, exactly_one=False)
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "ping", "parameters": {}}],
                        schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([], schema)


def test_duplicate_names_and_bad_shapes():
    with pytest.raises(ToolChoiceError):
        plan(tools=TOOLS + TOOLS[:1])
    with pytest.raises(ValueError):  # pydantic: parameters must be an object
        req(tools=[{"type": "function", "function": {"name": "f", "parameters": "x"}}])


def _serving(tokenizer):
    from radixlm.srt.openai_serving import OpenAIServing
    tm = SimpleNamespace(tokenizer=tokenizer, args=SimpleNamespace(tool_call_parser=None), model_path="/m",
                         context_len=2048, vocab_size=49152)
    return OpenAIServing(tm, "m")


def test_tools_and_earlier_calls_reach_the_chat_template(smollm2_tokenizer):
    tok = copy.deepcopy(smollm2_tokenizer)
    tok.chat_template = TOOL_TEMPLATE
    serving = _serving(tok)
    assert serving.tool_format is QWEN25  # chosen from the template's <tool_call>
    r = ChatCompletionRequest(tools=TOOLS, messages=[
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])
    text = tok.decode(asyncio.run(serving.chat_prompt_ids(r)))
    assert '"name": "get_weather"' in text and "Weather of a city" in text  # the tools
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text
    assert "sunny" in text
    none = ChatCompletionRequest(tools=TOOLS, tool_choice="none", messages=[{"role": "user", "content": "x"}])
    assert "# Tools" not in tok.decode(asyncio.run(serving.chat_prompt_ids(none)))
