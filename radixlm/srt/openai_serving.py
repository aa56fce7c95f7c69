"""/v1/completions and /v1/chat/completions on top of the TokenizerManager.

Everything that can be validated is validated before the first token is requested (model
name, prompt length against the context, sampling values), so a bad request is a 400 and
never a half-sent stream. Prompts are tokenized here (chat template included) so the
context check knows the prompt length; the tokenizer manager then gets token ids.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from starlette.types import Receive

from radixlm.sampling_params import SamplingParams
from radixlm.sampling_params import GRAMMAR_KINDS
from radixlm.validation import check_top_logprobs_num
from radixlm.srt.chat_template import ChatTemplateError, ChatTemplateRenderer
from radixlm.srt.constrained.response_format import response_format_to_sampling_params
from radixlm.srt.function_call.formats import TOOL_CALL_PARSER_NAMES, select_format
from radixlm.srt.function_call.stream import CallArgs, CallStart, Text, ToolCallStream
from radixlm.srt.function_call.tool_choice import (ToolChoiceError, ToolPlan, plan_tools, template_tool_calls,
                                                   template_tools)
from radixlm.srt.text_bound import check_text_length
from radixlm.srt.http_utils import (SSE_DONE, HTTPError, ORJSONResponse, SSEResponse, abort_error, error_body,
                                    merge_streams, next_or_disconnect, sse_event)
from radixlm.srt.openai_format import (TokenBytes, chat_logprobs, completion_logprobs, finish_reason_str,
                                       matched_stop, merge_completion_logprobs, usage_from)
from radixlm.srt.served_name import model_name_aliases
from radixlm.srt.openai_protocol import (ChatChoice, ChatCompletionRequest, ChatCompletionResponse,
                                         ChatCompletionStreamResponse, ChatResponseMessage, ChatStreamChoice,
                                         CompletionChoice, CompletionRequest, CompletionResponse,
                                         CompletionStreamResponse, DeltaFunctionCall, DeltaMessage, DeltaToolCall,
                                         FunctionCall, ModelCard, ModelList, PromptTokensDetails, ToolCall,
                                         UsageInfo, _SamplingRequest)

logger = logging.getLogger(__name__)

# Prompts longer than this (characters) are tokenized in a worker thread.
TOKENIZE_INLINE_MAX_CHARS = 20_000
# OpenAI's default max_tokens for the legacy completions API.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
CHAT_ROLES = {"system", "user", "assistant", "tool"}
# SamplingParams names → the OpenAI names users wrote, for error messages.
PARAM_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}


@dataclass
class Job:
    """One validated OpenAI request: P prompts × n choices, choice index = p * n + j."""
    chat: bool
    id: str
    model: str
    rids: list[str]
    prompts: list[list[int]]
    echo_texts: list[str]
    sampling: list[dict]
    n: int
    return_logprob: bool
    top_logprobs: int
    logprob_start_len: int | None
    include_usage: bool
    timeout: float | None
    priority: int | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage in every chunk
    tools: ToolPlan | None = None  # set when the output is read for tool calls
    # disaggregation: the gateway's bootstrap_host/port/room (scalars, or a list per prompt)
    bootstrap: dict[str, Any] = field(default_factory=dict)

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n

    def tm_kwargs(self, p: int | None, stream: bool) -> dict:
        """TokenizerManager.generate_request kwargs: one prompt p, or the whole batch."""
        sel = range(len(self.prompts)) if p is None else [p]
        one = p is not None or len(self.prompts) == 1
        pick = (lambda xs: xs[sel[0]]) if one else (lambda xs: [xs[i] for i in sel])
        boot = {f"bootstrap_{k}": pick(v) if isinstance(v, list) else v for k, v in self.bootstrap.items()}
        return dict(input_ids=pick(self.prompts), sampling_params=pick(self.sampling), rid=pick(self.rids),
                    return_logprob=self.return_logprob, top_logprobs_num=self.top_logprobs,
                    logprob_start_len=self.logprob_start_len, stream=stream, timeout=self.timeout,
                    priority=self.priority,
                    return_text_in_logprobs=True, **boot)


class OpenAIServing:
    def __init__(self, tm, served_model_name: str) -> None:
        self.tm = tm
        self.served_model_name = served_model_name
        self.token_bytes = TokenBytes(tm.tokenizer)
        self.chat_templates = ChatTemplateRenderer(tm.tokenizer, getattr(tm.args, "allow_client_chat_template", False),
                                                   getattr(tm.args, "chat_template_timeout", 5.0))
        # how tool calls are read for tool_choice=auto: the flag's format, else the template's
        self.tool_format = select_format(getattr(tm.args, "tool_call_parser", None),
                                         getattr(tm.tokenizer, "chat_template", None))
        self._warned_unparsed = False

    # ------------------------------------------------------------------ models
    def model_names(self) -> set[str]:
        return model_name_aliases(self.tm.model_path, self.served_model_name)

    def models(self) -> ModelList:
        # root is the served name, as vLLM and SGLang report it (not a file-system path)
        return ModelList(data=[ModelCard(id=self.served_model_name, root=self.served_model_name,
                                         max_model_len=self.tm.context_len)])

    def check_model(self, name: str | None) -> str:
        if name and name not in self.model_names():
            raise HTTPError(f"The model `{name}` does not exist.", status=404, param="model")
        return self.served_model_name

    # ------------------------------------------------------------------ entry points
    def _need_tokenizer(self) -> None:
        if self.tm.tokenizer is None:
            raise HTTPError("the OpenAI routes need a tokenizer, and this server runs with --skip-tokenizer-init: "
                            "use /generate with input_ids")

    async def create_completion(self, req: CompletionRequest, receive: Receive):
        model = self.check_model(req.model)
        self._need_tokenizer()
        if req.suffix:
            raise HTTPError("suffix is not supported", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise HTTPError("best_of is not supported (use n)", param="best_of")
        prompts, texts = await self._completion_prompts(req.prompt)
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
        job = self._job(req, chat=False, model=model, prompts=prompts, max_tokens=max_tokens,
                        return_logprob=req.logprobs is not None, top_logprobs=req.logprobs or 0)
        if req.echo:
            job.echo_texts = texts
            if job.return_logprob:
                job.logprob_start_len = 0  # echo with logprobs returns the prompt's logprobs too
        return await self._serve(job, req.stream, receive)

    async def create_chat_completion(self, req: ChatCompletionRequest, receive: Receive):
        job = await self.chat_job(req)
        return await self._serve(job, req.stream, receive)

    async def chat_job(self, req: ChatCompletionRequest, model: str | None = None) -> Job:
        """A chat request validated and tokenized (/v1/chat/completions, /v1/responses)."""
        model = model or self.check_model(req.model)
        self._need_tokenizer()
        try:
            plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, self.tool_format)
        except ToolChoiceError as e:
            raise HTTPError(str(e), param=e.param) from e
        if plan.unparsed and not self._warned_unparsed:
            self._warned_unparsed = True
            logger.warning('tool_choice "auto" (or tools without tool_choice) on a server with no tool-call '
                           'parser: answering with plain text and no tool_calls; start it with '
                           '--tool-call-parser {%s} to read calls from the output',
                           ",".join(TOOL_CALL_PARSER_NAMES))
        if req.top_logprobs and not req.logprobs:
            raise HTTPError("top_logprobs requires logprobs=true", param="top_logprobs")
        if req.max_tokens is not None and req.max_completion_tokens is not None \
                and req.max_tokens != req.max_completion_tokens:
            raise HTTPError("max_tokens and max_completion_tokens differ", param="max_completion_tokens")
        ids = await self._chat_prompt(req, plan.template_tools)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        job = self._job(req, chat=True, model=model, prompts=[ids], max_tokens=max_tokens,
                        return_logprob=req.logprobs, top_logprobs=req.top_logprobs or 0,
                        forced_schema=plan.json_schema)
        job.tools = plan if plan.fmt is not None else None
        return job

    async def chat_prompt_ids(self, req: ChatCompletionRequest) -> list[int]:
        """The prompt ids a chat request gets (chat template, tools): /tokenize uses it."""
        return await self._chat_prompt(req, template_tools(req.tools, req.tool_choice), for_context=False)

    # ------------------------------------------------------------------ preparation
    async def _tokenize(self, texts: list[str], param: str | None) -> list[list[int]]:
        """param: the request field the texts come from; None: they need not fit the context."""
        enc = self.tm.tokenizer.encode
        for t in texts if param is not None else []:  # refused before the costly tokenizing
            try:
                check_text_length(self.tm.tokenizer, len(t), self.tm.context_len)
            except ValueError as e:
                raise HTTPError(str(e), param=param) from e

        def run() -> list[list[int]]:
            # add_special_tokens=False: the same ids the Engine gets for the same text
            return [enc(t, add_special_tokens=False) for t in texts]
        if sum(map(len, texts)) < TOKENIZE_INLINE_MAX_CHARS:
            return run()
        return await asyncio.get_running_loop().run_in_executor(None, run)

    async def _completion_prompts(self, prompt: Any) -> tuple[list[list[int]], list[str]]:
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt:
            raise HTTPError("the prompt is empty", param="prompt")
        if isinstance(prompt[0], int):
            prompt = [prompt]
        if isinstance(prompt[0], str):
            if not all(prompt):
                raise HTTPError("the prompt is empty", param="prompt")
            return await self._tokenize(prompt, "prompt"), list(prompt)
        if not all(prompt):
            raise HTTPError("the prompt is empty", param="prompt")
        bad = [t for ids in prompt for t in ids if not 0 <= t < self.tm.vocab_size]
        if bad:
            raise HTTPError(f"prompt token ids out of the vocabulary range [0, {self.tm.vocab_size}): {bad[:5]}",
                            param="prompt")
        texts = [self.tm.tokenizer.decode(ids) for ids in prompt]
        return [list(ids) for ids in prompt], texts

    async def _chat_prompt(self, req: ChatCompletionRequest, tools: list[dict] | None = None,
                           for_context: bool = True) -> list[int]:
        tok = self.tm.tokenizer
        if not getattr(tok, "chat_template", None):
            raise HTTPError("this model has no chat template; use /v1/completions", param="messages")
        messages = []
        for i, m in enumerate(req.messages):
            role = "system" if m.role == "developer" else m.role
            if role not in CHAT_ROLES:
                raise HTTPError(f"unsupported message role {m.role!r}", param=f"messages[{i}].role")
            content = m.content
            if isinstance(content, list):
                if any(p.type != "text" for p in content):
                    raise HTTPError("only text content parts are supported", param=f"messages[{i}].content")
                content = "".join(p.text or "" for p in content)
            message = {"role": role, "content": content or ""}
            if m.tool_calls:
                message["tool_calls"] = template_tool_calls(m.tool_calls)
            if m.tool_call_id is not None:
                message["tool_call_id"] = m.tool_call_id
            if m.name is not None:
                message["name"] = m.name
            messages.append(message)
        try:
            text = await self.chat_templates.render(
                messages, add_generation_prompt=req.add_generation_prompt and not req.continue_final_message,
                continue_final_message=req.continue_final_message, client_kwargs=req.chat_template_kwargs,
                tools=tools)
        except ChatTemplateError as e:
            raise HTTPError(str(e), param="chat_template_kwargs") from e
        except Exception as e:  # jinja errors: the template rejects these messages
            raise HTTPError(f"cannot apply the chat template: {e}", param="messages") from e
        return (await self._tokenize([text], "messages" if for_context else None))[0]

    def _job(self, req: _SamplingRequest, *, chat: bool, model: str, prompts: list[list[int]],
             max_tokens: int | None, return_logprob: bool, top_logprobs: int,
             forced_schema: str | None = None) -> Job:
        if req.model_extra:
            logger.debug("ignoring unsupported request fields: %s", sorted(req.model_extra))
        try:
            check_top_logprobs_num(top_logprobs, self.tm.limits, "top_logprobs" if chat else "logprobs")
        except ValueError as e:
            raise HTTPError(str(e), param="top_logprobs" if chat else "logprobs") from e
        ctx = self.tm.context_len
        sampling = []
        for ids in prompts:
            if len(ids) >= ctx:
                raise HTTPError(f"This model's maximum context length is {ctx} tokens. However, your prompt "
                                f"has {len(ids)} tokens.", param="messages" if chat else "prompt")
            budget = ctx - len(ids)
            want = budget if max_tokens is None else max_tokens  # chat default: up to the context end
            if isinstance(want, int) and want > budget:
                raise HTTPError(f"This model's maximum context length is {ctx} tokens. However, you "
                                f"requested {len(ids) + want} tokens ({len(ids)} in the prompt, {want} "
                                f"in the completion).", param="max_tokens")
            sampling.append(self._sampling(req, want, forced_schema))
        base = req.rid if isinstance(req.rid, str) else uuid.uuid4().hex
        if isinstance(req.rid, list):
            if len(req.rid) != len(prompts):
                raise HTTPError(f"rid has {len(req.rid)} entries but there are {len(prompts)} prompts", param="rid")
            rids = list(req.rid)
        else:
            rids = [base] if len(prompts) == 1 else [f"{base}_{p}" for p in range(len(prompts))]
        bootstrap = {k: getattr(req, f"bootstrap_{k}") for k in ("host", "port", "room")
                     if getattr(req, f"bootstrap_{k}") is not None}
        for k, v in bootstrap.items():  # a list has one entry per prompt
            if isinstance(v, list) and len(v) != len(prompts):
                raise HTTPError(f"bootstrap_{k} has {len(v)} entries but there are {len(prompts)} prompts",
                                param=f"bootstrap_{k}")
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        # SGLang's rule: continuous_usage_stats alone puts usage in every chunk (vLLM also wants
        # include_usage); include_usage adds the final usage-only chunk
        continuous_usage = bool(req.stream_options and req.stream_options.continuous_usage_stats)
        if req.stream_options is not None and not req.stream:
            raise HTTPError("stream_options is only allowed with stream=true", param="stream_options")
        return Job(chat=chat, id=("chatcmpl-" if chat else "cmpl-") + base, model=model, rids=rids,
                   prompts=prompts, echo_texts=[], sampling=sampling, n=req.n, return_logprob=return_logprob,
                   top_logprobs=top_logprobs, logprob_start_len=None, include_usage=include_usage,
                   timeout=req.timeout, priority=req.priority, continuous_usage=continuous_usage,
                   bootstrap=bootstrap)

    def _sampling(self, req: _SamplingRequest, max_tokens: int, forced_schema: str | None = None) -> dict:
        d: dict[str, Any] = {"max_new_tokens": max_tokens, "min_new_tokens": req.min_tokens, "n": req.n,
                             "ignore_eos": req.ignore_eos, "skip_special_tokens": req.skip_special_tokens,
                             "spaces_between_special_tokens": req.spaces_between_special_tokens,
                             "no_stop_trim": req.no_stop_trim}
        for name in ("temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
                     "repetition_penalty", "seed"):
            value = getattr(req, name)
            if value is not None:
                d[name] = value
        if req.stop is not None:
            d["stop"] = [req.stop] if isinstance(req.stop, str) else list(req.stop)
        if req.stop_token_ids:
            d["stop_token_ids"] = list(req.stop_token_ids)
        if req.stop_regex is not None:
            d["stop_regex"] = req.stop_regex
        try:
            d.update(response_format_to_sampling_params(req.response_format))
        except ValueError as e:
            raise HTTPError(str(e), param="response_format") from e
        for name in ("json_schema", "regex", "ebnf"):
            if getattr(req, name) is not None:
                d[name] = getattr(req, name)
        if forced_schema is not None:  # tool_choice required / named: the grammar writes the calls
            if any(k in d for k in GRAMMAR_KINDS):
                raise HTTPError("tool_choice 'required' or a named function cannot be combined with "
                                "response_format, json_schema, regex or ebnf", param="tool_choice")
            d["json_schema"] = forced_schema
        if req.logit_bias:
            d["logit_bias"] = dict(req.logit_bias)  # keys already token ids (validation.LogitBias)
        try:  # validate now: a bad value must be a 400 before anything is streamed
            SamplingParams.from_dict(dict(d)).verify(self.tm.vocab_size, self.tm.limits)
        except ValueError as e:
            word = str(e).split(" ", 1)[0].removeprefix("sampling_params.").rstrip(":")
            raise HTTPError(str(e), param=PARAM_NAMES.get(word, word if word.isidentifier() else None)) from e
        return d

    # ------------------------------------------------------------------ generation
    async def _serve(self, job: Job, stream: bool, receive: Receive):
        if not stream:
            agen = self.tm.generate_request(**job.tm_kwargs(None, stream=False))
            try:
                out = await next_or_disconnect(agen, receive)
            finally:
                await agen.aclose()
            results = out if isinstance(out, list) else [out]
            for r in results:
                err = abort_error(r["meta_info"])
                if err is not None:
                    raise HTTPError(err[1], status=err[0])
            return ORJSONResponse((self._chat_response if job.chat else self._completion_response)(job, results))
        gens = [self.tm.generate_request(**job.tm_kwargs(p, stream=True)) for p in range(len(job.prompts))]
        merged = merge_streams(gens)
        # The first chunk is awaited here so that an error before anything is streamed (bad
        # input 400, full queue 503) is a plain HTTP status, which a gateway can retry.
        first = await next_or_disconnect(merged, receive)
        err = abort_error(first[1]["meta_info"])
        if err is not None:
            await merged.aclose()
            raise HTTPError(err[1], status=err[0])
        return SSEResponse(self._stream_events(job, first, merged))

    async def _stream_events(self, job: Job, first: tuple[int, dict], merged: AsyncIterator) -> AsyncIterator[bytes]:
        started: set[int] = set()
        offsets = [0] * job.num_choices
        finals: list[dict | None] = [None] * job.num_choices
        tool_streams = [ToolCallStream(job.tools.fmt, job.tools.tool_names) for _ in range(job.num_choices)] \
            if job.tools is not None else None
        try:
            if job.chat:  # OpenAI sends the role in a first chunk of its own, per choice
                for i in range(job.num_choices):
                    usage = self._running_usage(job, {"prompt_tokens": len(job.prompts[i // job.n])})
                    yield self._chat_chunk(job, i, DeltaMessage(role="assistant", content=""), usage=usage)
            item: tuple[int, dict] | None = first
            while item is not None:
                p, chunk = item
                i = p * job.n + chunk.get("index", 0)
                meta = chunk["meta_info"]
                err = abort_error(meta)
                if err is not None:
                    yield sse_event(error_body(err[1], err[0]))
                    yield SSE_DONE
                    return
                event, offsets[i] = self._delta_event(job, i, chunk, i not in started, offsets[i],
                                                      tool_streams[i] if tool_streams else None)
                started.add(i)
                if event is not None:
                    yield event
                if meta.get("finish_reason") is not None:
                    finals[i] = meta
                try:
                    item = await merged.__anext__()
                except StopAsyncIteration:
                    item = None
            if job.include_usage:
                usage = usage_from([m or {} for m in finals], job.n)
                cls = ChatCompletionStreamResponse if job.chat else CompletionStreamResponse
                yield sse_event(cls(id=job.id, created=job.created, model=job.model, choices=[],
                                    usage=usage).model_dump())
            yield SSE_DONE
        except Exception as e:  # the headers are out: report in-band, then end the stream
            logger.exception("stream failed")
            yield sse_event(error_body(f"{type(e).__name__}: {e}", 400 if isinstance(e, ValueError) else 500))
            yield SSE_DONE
        finally:
            await merged.aclose()

    def _delta_event(self, job: Job, i: int, chunk: dict, is_first: bool, offset: int,
                     tool_stream: ToolCallStream | None = None) -> tuple[bytes | None, int]:
        meta = chunk["meta_info"]
        fr = meta.get("finish_reason")
        text = chunk["text"]
        entries = meta.get("output_token_logprobs") or [] if job.return_logprob else []
        tops = meta.get("output_top_logprobs") if job.return_logprob else None
        usage = self._running_usage(job, meta)
        if job.chat:
            calls = None
            fr_name = finish_reason_str(fr)
            if tool_stream is not None:
                text, calls = _tool_deltas(tool_stream.feed(text, final=fr is not None))
                if fr_name == "stop" and tool_stream.any_call:
                    fr_name = "tool_calls"
            if not text and not calls and not entries and fr is None:
                return None, offset
            lp = chat_logprobs(entries, tops, job.top_logprobs, self.token_bytes) if job.return_logprob else None
            content = text if text or not calls else None
            return self._chat_chunk(job, i, DeltaMessage(content=content, tool_calls=calls),
                                    lp, fr, usage=usage, finish_reason=fr_name), offset
        prefix_lp = None
        if is_first and job.echo_texts:
            text = job.echo_texts[i // job.n] + text
            if job.return_logprob:
                prefix_lp, _ = completion_logprobs(meta.get("input_token_logprobs") or [],
                                                   meta.get("input_top_logprobs"), offset)
            offset += len(job.echo_texts[i // job.n])  # the output starts after the echoed prompt
        if not text and not entries and fr is None:
            return None, offset
        lp = None
        if job.return_logprob:
            lp, offset = completion_logprobs(entries, tops, offset)
            if prefix_lp is not None:
                lp = merge_completion_logprobs(prefix_lp, lp)
        choice = CompletionChoice(index=i, text=text, logprobs=lp, finish_reason=finish_reason_str(fr),
                                  matched_stop=matched_stop(fr))
        return sse_event(CompletionStreamResponse(id=job.id, created=job.created, model=job.model,
                                                  choices=[choice], usage=usage).model_dump()), offset

    @staticmethod
    def _running_usage(job: Job, meta: dict) -> UsageInfo | None:
        """Usage so far of one choice, for continuous_usage_stats."""
        if not job.continuous_usage:
            return None
        prompt, done = int(meta.get("prompt_tokens", 0)), int(meta.get("completion_tokens", 0))
        return UsageInfo(prompt_tokens=prompt, completion_tokens=done, total_tokens=prompt + done,
                         prompt_tokens_details=PromptTokensDetails(cached_tokens=int(meta.get("cached_tokens", 0))))

    def _chat_chunk(self, job: Job, i: int, delta: DeltaMessage, logprobs=None, fr: dict | None = None,
                    usage: UsageInfo | None = None, finish_reason: str | None = None) -> bytes:
        finish_reason = finish_reason or finish_reason_str(fr)
        choice = ChatStreamChoice(index=i, delta=delta, logprobs=logprobs, finish_reason=finish_reason,
                                  matched_stop=None if finish_reason == "tool_calls" else matched_stop(fr))
        body = ChatCompletionStreamResponse(id=job.id, created=job.created, model=job.model,
                                            choices=[choice], usage=usage).model_dump()
        d = body["choices"][0]["delta"]  # OpenAI omits the role after the first chunk
        body["choices"][0]["delta"] = {k: v for k, v in d.items() if v is not None}
        if delta.tool_calls:  # and the fields a call's later deltas do not repeat
            body["choices"][0]["delta"]["tool_calls"] = [c.model_dump(exclude_none=True) for c in delta.tool_calls]
        return sse_event(body)

    # ------------------------------------------------------------------ non-streaming bodies
    def _completion_response(self, job: Job, results: list[dict]) -> dict:
        choices = []
        for i, r in enumerate(results):
            meta = r["meta_info"]
            text, lp, offset = r["text"], None, 0
            if job.echo_texts:
                text = job.echo_texts[i // job.n] + text
            if job.return_logprob:
                if job.echo_texts:
                    lp, _ = completion_logprobs(meta.get("input_token_logprobs") or [],
                                                meta.get("input_top_logprobs"), 0)
                    offset = len(job.echo_texts[i // job.n])
                out_lp, _ = completion_logprobs(meta.get("output_token_logprobs") or [],
                                                meta.get("output_top_logprobs"), offset)
                lp = out_lp if lp is None else merge_completion_logprobs(lp, out_lp)
            fr = meta.get("finish_reason")
            choices.append(CompletionChoice(index=i, text=text, logprobs=lp, finish_reason=finish_reason_str(fr),
                                            matched_stop=matched_stop(fr)))
        return CompletionResponse(id=job.id, created=job.created, model=job.model, choices=choices,
                                  usage=usage_from([r["meta_info"] for r in results], job.n)).model_dump()

    def _chat_response(self, job: Job, results: list[dict]) -> dict:
        choices = []
        for i, r in enumerate(results):
            meta = r["meta_info"]
            lp = None
            if job.return_logprob:
                lp = chat_logprobs(meta.get("output_token_logprobs") or [], meta.get("output_top_logprobs"),
                                   job.top_logprobs, self.token_bytes)
            fr = meta.get("finish_reason")
            message, fr_name = ChatResponseMessage(content=r["text"]), finish_reason_str(fr)
            if job.tools is not None:
                parsed = ToolCallStream(job.tools.fmt, job.tools.tool_names).parse(r["text"])
                calls = [ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
                         for c in parsed.calls]
                message = ChatResponseMessage(content=parsed.content, tool_calls=calls or None)
                if calls and fr_name == "stop":
                    fr_name = "tool_calls"
            choices.append(ChatChoice(index=i, message=message, logprobs=lp, finish_reason=fr_name,
                                      matched_stop=None if fr_name == "tool_calls" else matched_stop(fr)))
        return ChatCompletionResponse(id=job.id, created=job.created, model=job.model, choices=choices,
                                      usage=usage_from([r["meta_info"] for r in results], job.n)).model_dump()


def _tool_deltas(events) -> tuple[str, list[DeltaToolCall] | None]:
    """A chunk's normal text and its tool-call deltas (OpenAI's shape: id, type and name in a
    call's first delta, then argument pieces), one entry per call index touched."""
    text = ""
    calls: dict[int, DeltaToolCall] = {}
    for e in events:
        if isinstance(e, Text):
            text += e.text
        elif isinstance(e, CallStart):
            calls[e.index] = DeltaToolCall(index=e.index, id=e.id, type="function",
                                           function=DeltaFunctionCall(name=e.name, arguments=""))
        elif isinstance(e, CallArgs):
            d = calls.setdefault(e.index, DeltaToolCall(index=e.index, function=DeltaFunctionCall(arguments="")))
            d.function.arguments = (d.function.arguments or "") + e.fragment
    return text, list(calls.values()) or None
