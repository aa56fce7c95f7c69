"""Pydantic models of the OpenAI-compatible API (the subset radixlm serves) and the native
/generate body.

Request models accept unknown fields (clients send many optional OpenAI fields we have no
use for; the handler logs them), but type errors are rejected with 400 by the app. Types
are strict and the sampling fields share their types and ranges with the native
sampling params (radixlm/validation.py); null means the default.
Response models are dumped with `model_dump()`, so absent optional values appear as null,
as OpenAI's own responses do.
"""
from __future__ import annotations

import time
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from radixlm.srt.sglang_fields import METADATA_FIELDS, SGLangGenerateFields
from radixlm.validation import (AdditivePenalty, JsonSchemaInput, LogitBias, MinP, NonNegInt, PositiveInt,
                                PositiveSeconds, RepetitionPenalty, Seed, Stop, StopRegexInput, Temperature, TokenId,
                                TopK, TopP, sampling_params_input_model)

# Token-id prompts come before strings so that [1, 2] is read as ids, never coerced to text.
PromptType = Union[list[list[int]], list[int], list[str], str]


def _drop_nulls(data: Any) -> Any:
    """null means "the default" (SGLang's rule): a None field is as if it were absent."""
    return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    _nulls_are_defaults = model_validator(mode="before")(_drop_nulls)


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingRequest(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions, plus SGLang's extras."""

    model: str | None = None  # None: the one served model
    n: PositiveInt | None = 1
    max_tokens: NonNegInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: MinP | None = None
    stop: Stop | None = None
    seed: Seed | None = None
    frequency_penalty: AdditivePenalty | None = None
    presence_penalty: AdditivePenalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    logit_bias: LogitBias | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # extras (SGLang/vLLM names)
    ignore_eos: bool | None = False
    min_tokens: NonNegInt | None = 0
    skip_special_tokens: bool | None = True
    spaces_between_special_tokens: bool | None = True
    no_stop_trim: bool | None = False
    stop_token_ids: list[TokenId] | None = None
    stop_regex: StopRegexInput | None = None
    rid: str | list[str] | None = None
    timeout: PositiveSeconds | None = None  # per-request deadline in seconds (503 when exceeded)
    priority: int | None = None  # vLLM's field: with --enable-priority-scheduling (else ignored)
    # structured output: OpenAI's response_format, or SGLang's direct constraints
    response_format: dict[str, Any] | None = None
    json_schema: JsonSchemaInput | None = None
    regex: str | None = None
    ebnf: str | None = None
    # prefill/decode disaggregation: the gateway adds them (docs/disaggregation.md)
    bootstrap_host: str | list[str] | None = None
    bootstrap_port: int | list[int] | None = None
    bootstrap_room: int | list[int] | None = None


class CompletionRequest(_SamplingRequest):
    prompt: PromptType
    echo: bool | None = False
    logprobs: NonNegInt | None = None
    suffix: str | None = None
    best_of: PositiveInt | None = None


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
    max_completion_tokens: NonNegInt | None = None
    logprobs: bool | None = False
    top_logprobs: NonNegInt | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None


SamplingParamsInput = sampling_params_input_model()


class GenerateRequest(SGLangGenerateFields):
    """The native /generate body: SGLang's GenerateReqInput. The fields radixlm implements are
    declared here; the others (sglang_fields.py) are accepted at their neutral values.
    Unknown fields are rejected: a typo here would otherwise silently change sampling."""

    model_config = ConfigDict(extra="forbid", strict=True)
    _nulls_are_defaults = model_validator(mode="before")(_drop_nulls)

    text: str | list[str] | None = None
    input_ids: list[list[int]] | list[int] | None = None
    sampling_params: SamplingParamsInput | list[SamplingParamsInput] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    return_logprob: bool | list[bool] | None = False
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: NonNegInt | list[NonNegInt] | None = None
    # logprobs of these ids at every logprob position (one list, or one per prompt)
    token_ids_logprob: list[list[TokenId]] | list[TokenId] | None = None
    return_text_in_logprobs: bool | None = False
    rid: str | list[str] | None = None
    timeout: PositiveSeconds | None = None
    # prefix-cache namespaces (SGLang's names): requests share cached KV only with the same values
    extra_key: str | list[str] | None = None
    cache_salt: str | list[str] | None = None
    priority: int | list[int] | None = None  # with --enable-priority-scheduling (else ignored)
    session_params: dict[str, Any] | None = None  # a turn of an open session (/open_session)
    # prefill/decode disaggregation: where the KV comes from / goes (the gateway adds them; a
    # batch has one per prompt). docs/disaggregation.md
    bootstrap_host: str | list[str] | None = None
    bootstrap_port: int | list[int] | None = None
    bootstrap_room: int | list[int] | None = None

    def generate_kwargs(self) -> dict[str, Any]:
        """TokenizerManager.generate_request keywords (nulls dropped: the defaults apply); the
        SGLang fields radixlm does not implement go along to be checked with the rest."""
        kw = self.model_dump(exclude_none=True, exclude=set(SGLangGenerateFields.model_fields))
        kw.update({k: v for k, v in self.sglang_fields().items() if k not in METADATA_FIELDS})
        sp = self.sampling_params
        if sp is not None:  # only the fields the client gave: an explicit max_new_tokens is checked
            kw["sampling_params"] = ([p.model_dump(exclude_none=True) for p in sp] if isinstance(sp, list)
                                     else sp.model_dump(exclude_none=True))
        if "text" in kw:
            kw["prompt"] = kw.pop("text")
        return kw


class OpenSessionRequest(BaseModel):
    """SGLang's /open_session body (the capacity is in tokens here)."""
    model_config = ConfigDict(strict=True, extra="forbid")
    capacity_of_str_len: int = Field(gt=0)
    session_id: str | None = None
    timeout: float | None = Field(default=None, gt=0)


class CloseSessionRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    session_id: str


class AbortRequest(BaseModel):
    model_config = ConfigDict(strict=True)
    rid: str = ""
    abort_all: bool = False
    prefix: bool = False


class PauseRequest(BaseModel):
    model_config = ConfigDict(strict=True)
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
