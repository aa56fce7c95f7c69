"""/tokenize and /detokenize (also under /v1/), in SGLang's shapes.

    POST /tokenize   {"prompt": str | [str], "add_special_tokens": true}
                  or {"messages": [...], "tools": [...], "add_generation_prompt": true, ...}
                  -> {"tokens": [int] | [[int]], "count": int | [int], "max_model_len": int}
                     (+ "token_strs" with "return_token_strs": true, as vLLM answers)
    POST /detokenize {"tokens": [int] | [[int]], "skip_special_tokens": true}
                  -> {"text": str | [str]}

Chat messages are rendered by the same code as /v1/chat/completions (chat template, tools),
so the ids are exactly those a chat request would be given.
"""
from __future__ import annotations

import asyncio
from typing import Any, Callable

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field

from radixlm.srt.http_utils import HTTPError, ORJSONResponse, parse_body
from radixlm.srt.openai_protocol import ChatCompletionRequest, ChatMessage

# Texts longer than this (characters, all prompts together) are tokenized off the event loop.
TOKENIZE_INLINE_MAX_CHARS = 20_000


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    prompt: str | list[str] | None = None
    messages: list[ChatMessage] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = True  # for prompts; a chat template already writes its own
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    tokens: list[int] | list[list[int]] = Field(default_factory=list)
    skip_special_tokens: bool = True


# declared in /openapi.json (http_utils.declare_request_bodies)
TOKENIZE_REQUEST_BODIES = {("POST", path): model for paths, model in
                           ((("/tokenize", "/v1/tokenize"), TokenizeRequest),
                            (("/detokenize", "/v1/detokenize"), DetokenizeRequest)) for path in paths}


def add_tokenize_routes(app: FastAPI, ctx_of: Callable[[Request], Any]) -> None:
    @app.post("/tokenize")
    @app.post("/v1/tokenize")
    async def tokenize(request: Request):
        ctx, body, tok = await _begin(ctx_of(request), request, TokenizeRequest)
        if (body.prompt is None) == (body.messages is None):
            raise HTTPError("exactly one of prompt and messages must be given", param="prompt")
        if body.messages is not None:
            chat = ChatCompletionRequest(messages=body.messages, tools=body.tools, tool_choice=body.tool_choice,
                                         add_generation_prompt=body.add_generation_prompt,
                                         continue_final_message=body.continue_final_message,
                                         chat_template_kwargs=body.chat_template_kwargs)
            ids_list, single = [await ctx.openai.chat_prompt_ids(chat)], True
        else:
            single = isinstance(body.prompt, str)
            texts = [body.prompt] if single else list(body.prompt)
            ids_list = await _encode(tok, texts, body.add_special_tokens)
        out: dict[str, Any] = {"tokens": ids_list[0] if single else ids_list,
                               "count": len(ids_list[0]) if single else [len(i) for i in ids_list],
                               "max_model_len": ctx.tm.context_len}
        if body.return_token_strs:
            strs = [tok.convert_ids_to_tokens(ids) for ids in ids_list]
            out["token_strs"] = strs[0] if single else strs
        return ORJSONResponse(out)

    @app.post("/detokenize")
    @app.post("/v1/detokenize")
    async def detokenize(request: Request):
        ctx, body, tok = await _begin(ctx_of(request), request, DetokenizeRequest)
        single = not body.tokens or isinstance(body.tokens[0], int)
        lists = [body.tokens] if single else body.tokens
        vocab = ctx.tm.vocab_size
        bad = [t for ids in lists for t in ids if not 0 <= t < vocab]
        if bad:
            raise HTTPError(f"token ids out of the vocabulary range [0, {vocab}): {bad[:5]}", param="tokens")
        texts = [tok.decode(ids, skip_special_tokens=body.skip_special_tokens) for ids in lists]
        return ORJSONResponse({"text": texts[0] if single else texts})


async def _begin(ctx, request: Request, model: type[BaseModel]):
    """(server context, parsed body, tokenizer), or an HTTP error."""
    body = await parse_body(request, model)
    if ctx.tm.tokenizer is None:
        raise HTTPError("the server runs with --skip-tokenizer-init: it has no tokenizer")
    ctx.openai.check_model(body.model)
    return ctx, body, ctx.tm.tokenizer


async def _encode(tok, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
    def run() -> list[list[int]]:
        return [tok.encode(t, add_special_tokens=add_special_tokens) for t in texts]
    if sum(map(len, texts)) < TOKENIZE_INLINE_MAX_CHARS:
        return run()
    return await asyncio.get_running_loop().run_in_executor(None, run)
