"""The OpenAI Responses API (`/v1/responses`): the request body, its translation into a chat
request, and the response object and its output items.

    input          a string (one user turn) or a list of items: messages ({"role", "content"}
                   with a string or input_text/output_text parts), function_call and
                   function_call_output items
    instructions   a system turn before everything (not carried by previous_response_id)
    tools          function tools ({"type": "function", "name", "parameters", ...})
    text.format    {"type": "text" | "json_object" | "json_schema", "schema", ...}

The chat template, tool-call parsing and sampling are those of /v1/chat/completions.
"""
from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from radixlm.srt.http_utils import HTTPError
from radixlm.srt.openai_protocol import ChatCompletionRequest, _Request
from radixlm.validation import NonNegInt, Temperature, TopP


class FunctionTool(BaseModel):
    model_config = ConfigDict(strict=True)
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(BaseModel):
    model_config = ConfigDict(strict=True)
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    format: TextFormat | None = None


class ResponsesRequest(_Request):
    """Unknown fields are accepted (OpenAI adds them often) and ignored, as on the chat route;
    the sampling extras of the chat route (top_k, min_p, ...) pass through."""

    model: str | None = None
    input: Union[str, list[dict[str, Any]]]
    instructions: str | None = None
    max_output_tokens: NonNegInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedFunction, None] = None
    parallel_tool_calls: bool | None = True
    text: TextConfig | None = None
    stream: bool | None = False
    store: bool | None = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["disabled"] | None = "disabled"
    background: Literal[False] | None = False
    reasoning: None = None  # no reasoning parser: only null


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# ---------------------------------------------------------------------------- input → chat messages
def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
                raise HTTPError("only text content parts (input_text, output_text) are supported",
                                param=f"{where}.content[{j}]")
            text = part.get("text")
            if not isinstance(text, str):
                raise HTTPError("a text content part needs a string `text`", param=f"{where}.content[{j}]")
            parts.append(text)
        return "".join(parts)
    raise HTTPError("a message's content must be a string or a list of text parts", param=f"{where}.content")


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's input as chat messages (OpenAI chat shape: role, content, tool_calls)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not items:
        raise HTTPError("input is empty", param="input")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise HTTPError(f"unsupported message role {role!r}", param=f"{where}.role")
            out.append({"role": "system" if role == "developer" else role,
                        "content": _content_text(item.get("content"), where)})
        elif kind == "function_call":
            name, args, call_id = item.get("name"), item.get("arguments"), item.get("call_id")
            if not (isinstance(name, str) and isinstance(args, str) and isinstance(call_id, str)):
                raise HTTPError("a function_call item needs string name, arguments and call_id", param=where)
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str) or not isinstance(output, str):
                raise HTTPError("a function_call_output item needs string call_id and output", param=where)
            out.append({"role": "tool", "tool_call_id": call_id, "content": output})
        else:
            raise HTTPError(f"unsupported input item type {kind!r}", param=f"{where}.type")
    return out


def output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the assistant turn(s) a follow-up request continues."""
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    return [{"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}]


def chat_request(req: ResponsesRequest, history: list[dict[str, Any]], rid: str) -> ChatCompletionRequest:
    """The chat request a Responses request amounts to (validated like one)."""
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + history
    body: dict[str, Any] = dict(req.model_extra or {})
    body.update(messages=messages, rid=rid, stream=bool(req.stream), parallel_tool_calls=req.parallel_tool_calls,
                max_completion_tokens=req.max_output_tokens, temperature=req.temperature, top_p=req.top_p)
    if req.tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                         for t in req.tools]
    if req.tool_choice is not None:
        choice = req.tool_choice
        body["tool_choice"] = choice if isinstance(choice, str) else \
            {"type": "function", "function": {"name": choice.name}}
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.name or "output", "schema": fmt.schema_ or {"type": "object"}, "strict": fmt.strict}}
    elif fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})


# ---------------------------------------------------------------------------- the response object
def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if text or \
        status == "completed" else []
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def usage(meta: dict | None) -> dict[str, Any] | None:
    if meta is None:
        return None
    prompt, done = int(meta.get("prompt_tokens", 0)), int(meta.get("completion_tokens", 0))
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": int(meta.get("cached_tokens", 0))},
            "output_tokens": done, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + done}


def response_object(resp_id: str, req: ResponsesRequest, model: str, created_at: int, status: str,
                    output: list[dict[str, Any]], meta: dict | None = None) -> dict[str, Any]:
    fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format \
        else {"type": "text"}
    choice = req.tool_choice
    return {
        "id": resp_id, "object": "response", "created_at": created_at, "status": status, "model": model,
        "output": output, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "metadata": req.metadata or {}, "parallel_tool_calls": bool(req.parallel_tool_calls),
        "previous_response_id": req.previous_response_id, "reasoning": None, "store": bool(req.store),
        "temperature": 1.0 if req.temperature is None else req.temperature, "text": {"format": fmt},
        "tool_choice": (choice if isinstance(choice, str) else choice.model_dump()) if choice is not None
        else "auto", "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
        "top_p": 1.0 if req.top_p is None else req.top_p, "truncation": "disabled", "user": req.user,
        "usage": usage(meta),
    }


def now() -> int:
    return int(time.time())
