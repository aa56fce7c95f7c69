"""What a chat request's `tools` and `tool_choice` mean: the tools the chat template renders,
the grammar that forces calls, and how the output is read.

    none       tools are not rendered; the output is plain content
    auto       tools rendered; the output is read with the server's tool-call format; with
               none (no --tool-call-parser, no format in the chat template) it is plain
               content and no tool_calls, as SGLang answers (ToolPlan.unparsed)
    required   tools rendered; the grammar (xgrammar, JSON schema) forces a JSON array of one
    {"type": "function", "function": {"name": f}}
               or more calls [{"name": ..., "parameters": {...}}] (exactly f's, once, for a
               named function; one call when parallel_tool_calls is false), valid whatever the
               weights; read with the FORCED format.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from radixlm.srt.function_call.formats import FORCED, ToolCallFormat

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


class ToolChoiceError(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class ToolPlan:
    template_tools: list[dict] | None = None  # for apply_chat_template(tools=...)
    json_schema: str | None = None  # the grammar forcing the calls
    fmt: ToolCallFormat | None = None  # how calls are read from the output; None: plain content
    tool_names: set[str] = field(default_factory=set)
    # tool_choice auto with no tool-call format: answered as plain text (the server warns once)
    unparsed: bool = False


def template_tools(tools, tool_choice) -> list[dict] | None:
    """The tools as the chat template receives them (OpenAI's shape), unless tool_choice is none."""
    if not tools or tool_choice == "none":
        return None
    return [t.model_dump(exclude_none=True) for t in tools]


def plan_tools(tools, tool_choice, parallel_tool_calls: bool, fmt: ToolCallFormat | None) -> ToolPlan:
    """Validated plan for a request; ToolChoiceError (a 400) otherwise."""
    names = [t.function.name for t in tools or []]
    if len(set(names)) != len(names):
        raise ToolChoiceError("tool function names must be unique", "tools")
    choice = tool_choice if tool_choice is not None else ("auto" if tools else "none")
    if not tools:
        if choice in ("none", "auto"):
            return ToolPlan()
        raise ToolChoiceError("tool_choice requires tools", "tool_choice")
    plan = ToolPlan(template_tools=template_tools(tools, choice), tool_names=set(names))
    if choice == "none":
        return plan
    if choice == "auto":
        plan.fmt = fmt
        plan.unparsed = fmt is None
        return plan
    if choice == "required":
        chosen, one = list(tools), not parallel_tool_calls
    else:  # a named function
        name = choice.function.name
        chosen = [t for t in tools if t.function.name == name]
        if not chosen:
            raise ToolChoiceError(f"tool_choice names the function {name!r}, which is not in tools",
                                  "tool_choice")
        one = True
    plan.json_schema = json.dumps(calls_schema(chosen, one))
    plan.fmt = FORCED
    return plan


def calls_schema(tools, exactly_one: bool) -> dict:
    """JSON schema of a non-empty array of calls [{"name": ..., "parameters": {...}}]."""
    items = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [t.function.name]},
                             "parameters": t.function.parameters or EMPTY_PARAMETERS},
              "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if exactly_one:
        schema["maxItems"] = 1
    return schema


def template_tool_calls(tool_calls: list[dict] | None) -> list[dict] | None:
    """An assistant message's earlier calls for the chat template: templates (Qwen2.5,
    Llama 3.1) render `arguments | tojson`, so JSON-text arguments become objects."""
    if not tool_calls:
        return None
    out = []
    for call in tool_calls:
        call = dict(call)
        fn = dict(call.get("function") or {})
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                parsed = json.loads(args)
            except ValueError:
                parsed = None
            if isinstance(parsed, dict):
                fn["arguments"] = parsed
        call["function"] = fn
        out.append(call)
    return out
