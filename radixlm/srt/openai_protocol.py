"""Pydantic models of the OpenAI-compatible API (the subset radixlm serves) and the native
/generate body.

Request models accept unknown fields (clients send many optional OpenAI fields we have no
use for; the handler logs them), but type errors are rejected with 400 by the app.
Response models are dumped with `model_dump()`, so absent optional values appear as null,
as OpenAI's own responses do.
"""
from __future__ import annotations

import time
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

# Token-id prompts come before strings so that [1, 2] is read as ids, never coerced to text.
PromptType = Union[list[list[int]], list[int], list[str], str]


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingRequest(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions, plus SGLang's extras."""

    model: str | None = None  # None: the one served model
    n: int = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # extras (SGLang/vLLM names)
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None
    rid: str | list[str] | None = None
    timeout: float | None = None  # per-request deadline in seconds (503 when exceeded)
    # structured output: OpenAI's response_format, or SGLang's direct constraints
    response_format: dict[str, Any] | None = None
    json_schema: str | dict[str, Any] | None = None
    regex: str | None = None
    ebnf: str | None = None


class CompletionRequest(_SamplingRequest):
    prompt: PromptType
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)
    suffix: str | None = None
    best_of: int | None = None


class ContentPart(_Request):
    type: str
    text: str | None = None


class ChatMessage(_Request):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn's earlier calls
    tool_call_id: str | None = None  # a tool turn answers this call


class FunctionDefinition(BaseModel):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None


class ChatTool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ToolChoiceFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: ToolChoiceFunction


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class GenerateRequest(BaseModel):
    """The native /generate body (SGLang's GenerateReqInput, the fields radixlm supports).
    Unknown fields are rejected: a typo here would otherwise silently change sampling."""

    model_config = ConfigDict(extra="forbid")

    text: str | list[str] | None = None
    input_ids: list[list[int]] | list[int] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    stream: bool = False
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    return_text_in_logprobs: bool = False
    rid: str | list[str] | None = None
    timeout: float | None = None
    # The SGLang Model Gateway (smg) re-serializes every /generate it forwards and adds these
    # fields at their defaults. An explicit allow-list: each is accepted at the value that
    # means "nothing special" and none reaches the engine (GATEWAY_GENERATE_FIELDS).
    model: str | None = None  # smg routes by it ("unknown" when the client named none)
    log_metrics: bool = True
    no_logs: bool = False  # radixlm never logs prompts or outputs
    background: bool = False
    return_bytes: bool = False
    return_entropy: bool = False
    return_hidden_states: bool = False

    @field_validator("background", "return_bytes", "return_entropy", "return_hidden_states", mode="before")
    @classmethod
    def _default_only(cls, v: Any, info: ValidationInfo) -> bool:
        if v not in (False, None):
            raise ValueError(f"{info.field_name}={v!r} is not supported (only false)")
        return False


# Fields of GenerateRequest that are protocol noise from the gateway, not generation input.
GATEWAY_GENERATE_FIELDS = frozenset({"model", "log_metrics", "no_logs", "background", "return_bytes",
                                     "return_entropy", "return_hidden_states"})


class AbortRequest(BaseModel):
    rid: str = ""
    abort_all: bool = False
    prefix: bool = False


class PauseRequest(BaseModel):
    mode: Literal["abort", "retract", "in_place"] = "abort"


# ---------------------------------------------------------------------------- responses
def _now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "radixlm"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard] = Field(default_factory=list)


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: str = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class CompletionStreamResponse(CompletionResponse):
    pass


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] = Field(default_factory=list)


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: str = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A streamed piece of a tool call: id, type and name come in the call's first delta."""
    index: int
    id: str | None = None
    type: str | None = None
    function: DeltaFunctionCall


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: str = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: str = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
