"""/v1/responses: OpenAI's Responses API on top of the chat path.

    POST   /v1/responses               create (plain, or streamed as typed events)
    GET    /v1/responses/{id}          a stored response (store: true, the default)
    POST   /v1/responses/{id}/cancel   abort a running one through the normal stop path
    DELETE /v1/responses/{id}          forget a stored one

Stored responses (their request's conversation and their output, so `previous_response_id`
can continue them) are kept in memory, the least recently used dropped beyond
--max-stored-responses. A streamed answer is the event sequence OpenAI's clients parse:
response.created, response.in_progress, then per output item output_item.added, its content
part or argument deltas and their .done events, output_item.done, and at the end
response.completed (response.incomplete when max_output_tokens cut it, or it was cancelled).
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

import orjson
from fastapi import FastAPI, Request
from starlette.types import Receive

from radixlm.srt.function_call.stream import CallArgs, CallEnd, CallStart, Text, ToolCallStream
from radixlm.srt.http_utils import (HTTPError, ORJSONResponse, SSEResponse, abort_error, error_body,
                                    next_or_disconnect, parse_body)
from radixlm.srt.responses_protocol import (ResponsesRequest, chat_request, function_call_item, input_messages,
                                            message_item, new_id, now, output_messages, response_object)

logger = logging.getLogger(__name__)


@dataclass
class StoredResponse:
    request: ResponsesRequest
    history: list[dict[str, Any]]  # the conversation it answered, instructions excluded
    body: dict[str, Any]  # the response object as last reported


class ResponseStore:
    """Responses by id, the least recently used dropped beyond `capacity`."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, resp_id: str, entry: StoredResponse) -> None:
        self._items[resp_id] = entry
        self._items.move_to_end(resp_id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, resp_id: str) -> StoredResponse | None:
        entry = self._items.get(resp_id)
        if entry is not None:
            self._items.move_to_end(resp_id)
        return entry

    def pop(self, resp_id: str) -> StoredResponse | None:
        return self._items.pop(resp_id, None)

    def __len__(self) -> int:
        return len(self._items)


def _status(meta: dict) -> str:
    fr = meta.get("finish_reason") or {}
    if fr.get("type") == "length":
        return "incomplete"
    if fr.get("type") == "abort":
        return "cancelled"
    return "completed"


class ResponsesServing:
    def __init__(self, openai, capacity: int) -> None:
        self.openai = openai  # OpenAIServing: model names, chat template, tool plans, jobs
        self.tm = openai.tm
        self.store = ResponseStore(capacity)
        self.running: set[str] = set()  # ids whose generation is in progress (cancellable)

    # ------------------------------------------------------------------ create
    async def create(self, req: ResponsesRequest, receive: Receive):
        model = self.openai.check_model(req.model)
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            prev = self.store.get(req.previous_response_id)
            if prev is None:
                raise HTTPError(f"Previous response with id '{req.previous_response_id}' not found.", status=404,
                                param="previous_response_id")
            if prev.body["status"] == "in_progress":
                raise HTTPError(f"Previous response '{req.previous_response_id}' is still in progress.",
                                param="previous_response_id")
            history = prev.history + output_messages(prev.body["output"])
        history = history + input_messages(req.input)
        resp_id = new_id("resp")
        chat = chat_request(req, history, resp_id)
        if chat.n != 1:
            raise HTTPError("a response has one output: n must be 1", param="n")
        job = await self.openai.chat_job(chat, model)
        created = now()
        entry = StoredResponse(req, history, response_object(resp_id, req, model, created, "in_progress", []))
        if req.store:
            self.store.put(resp_id, entry)
        if not req.stream:
            self.running.add(resp_id)
            try:
                agen = self.tm.generate_request(**job.tm_kwargs(None, stream=False))
                try:
                    out = await next_or_disconnect(agen, receive)
                finally:
                    await agen.aclose()
            except BaseException:
                self._forget_failed(resp_id)
                raise
            finally:
                self.running.discard(resp_id)
            meta = out["meta_info"]
            err = abort_error(meta)
            if err is not None:
                self._forget_failed(resp_id)
                raise HTTPError(err[1], status=err[0])
            output = self._output(job, out["text"])
            entry.body = response_object(resp_id, req, model, created, _status(meta), output, meta)
            return ORJSONResponse(entry.body)
        self.running.add(resp_id)  # cancellable from now on
        agen = self.tm.generate_request(**job.tm_kwargs(0, stream=True))
        try:
            first = await next_or_disconnect(agen, receive)
            err = abort_error(first["meta_info"])
            if err is not None:
                raise HTTPError(err[1], status=err[0])
        except BaseException:
            await agen.aclose()
            self.running.discard(resp_id)
            self._forget_failed(resp_id)
            raise
        return SSEResponse(_Events(self, job, entry, resp_id, model, created).run(first, agen))

    def _forget_failed(self, resp_id: str) -> None:
        self.store.pop(resp_id)

    @staticmethod
    def _output(job, text: str) -> list[dict[str, Any]]:
        if job.tools is None:
            return [message_item(new_id("msg"), text, "completed")] if text else []
        parsed = ToolCallStream(job.tools.fmt, job.tools.tool_names).parse(text)
        out = [message_item(new_id("msg"), parsed.content, "completed")] if parsed.content else []
        out += [function_call_item(new_id("fc"), c.id, c.name, c.arguments,
                                   "completed" if c.complete else "incomplete") for c in parsed.calls]
        return out

    # ------------------------------------------------------------------ stored
    def _stored(self, resp_id: str) -> StoredResponse:
        entry = self.store.get(resp_id)
        if entry is None:
            raise HTTPError(f"Response with id '{resp_id}' not found.", status=404, param="response_id")
        return entry

    def retrieve(self, resp_id: str) -> dict[str, Any]:
        return self._stored(resp_id).body

    def cancel(self, resp_id: str) -> dict[str, Any]:
        entry = self._stored(resp_id)
        if resp_id in self.running:  # its caller is answered at once; the body follows
            self.tm.abort_request(resp_id)
            entry.body = {**entry.body, "status": "cancelled"}
        return entry.body

    def delete(self, resp_id: str) -> dict[str, Any]:
        self._stored(resp_id)
        if resp_id in self.running:
            self.tm.abort_request(resp_id)
        self.store.pop(resp_id)
        return {"id": resp_id, "object": "response", "deleted": True}


class _Events:
    """One streamed response: generation chunks in, Responses events out."""

    def __init__(self, serving: ResponsesServing, job, entry: StoredResponse, resp_id: str, model: str,
                 created: int) -> None:
        self.serving, self.job, self.entry = serving, job, entry
        self.resp_id, self.model, self.created = resp_id, model, created
        self.seq = 0
        self.output: list[dict[str, Any]] = []
        self.message: dict[str, Any] | None = None  # the open message item
        self.calls: dict[int, dict[str, Any]] = {}  # open function_call items by call index
        self.tools = ToolCallStream(job.tools.fmt, job.tools.tool_names) if job.tools is not None else None

    def event(self, kind: str, **fields: Any) -> bytes:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(body) + b"\n\n"

    def response(self, status: str, meta: dict | None = None) -> dict[str, Any]:
        return response_object(self.resp_id, self.entry.request, self.model, self.created, status,
                               list(self.output), meta)

    async def run(self, first: dict, agen) -> AsyncIterator[bytes]:
        try:
            yield self.event("response.created", response=self.response("in_progress"))
            yield self.event("response.in_progress", response=self.response("in_progress"))
            chunk: dict | None = first
            meta: dict = {}
            while chunk is not None:
                meta = chunk["meta_info"]
                err = abort_error(meta)
                if err is not None:
                    self.serving._forget_failed(self.resp_id)
                    yield self.event("error", code=str(err[0]), message=err[1], param=None)
                    return
                final = meta.get("finish_reason") is not None
                events = self.tools.feed(chunk["text"], final=final) if self.tools is not None \
                    else [Text(chunk["text"])] if chunk["text"] else []
                for e in events:
                    for out in self.on(e):
                        yield out
                try:
                    chunk = await agen.__anext__()
                except StopAsyncIteration:
                    chunk = None
            for out in self.close_message():
                yield out
            status = _status(meta)
            self.entry.body = self.response(status, meta)
            kind = "response.completed" if status == "completed" else "response.incomplete"
            yield self.event(kind, response=self.entry.body)
        except Exception as e:  # the headers are out: report in-band
            logger.exception("/v1/responses stream failed")
            self.serving._forget_failed(self.resp_id)
            yield self.event("error", code="500", message=error_body(f"{type(e).__name__}: {e}", 500)["error"]
                             ["message"], param=None)
        finally:
            self.serving.running.discard(self.resp_id)
            await agen.aclose()

    def on(self, e) -> list[bytes]:
        out: list[bytes] = []
        if isinstance(e, Text):
            if not e.text:
                return out
            if self.message is None:
                self.message = message_item(new_id("msg"), "", "in_progress")
                self.message["index"] = len(self.output)
                self.output.append(self.message)
                item = {k: v for k, v in self.message.items() if k != "index"}
                out.append(self.event("response.output_item.added", output_index=self.message["index"], item=item))
                self.message["content"] = [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]
                out.append(self.event("response.content_part.added", item_id=self.message["id"],
                                      output_index=self.message["index"], content_index=0,
                                      part={"type": "output_text", "text": "", "annotations": []}))
            self.message["content"][0]["text"] += e.text
            out.append(self.event("response.output_text.delta", item_id=self.message["id"],
                                  output_index=self.message["index"], content_index=0, delta=e.text, logprobs=[]))
        elif isinstance(e, CallStart):
            out += self.close_message()
            item = function_call_item(new_id("fc"), e.id, e.name, "", "in_progress")
            self.calls[e.index] = {"item": item, "index": len(self.output)}
            self.output.append(item)
            out.append(self.event("response.output_item.added", output_index=len(self.output) - 1, item=dict(item)))
        elif isinstance(e, CallArgs):
            call = self.calls[e.index]
            call["item"]["arguments"] += e.fragment
            out.append(self.event("response.function_call_arguments.delta", item_id=call["item"]["id"],
                                  output_index=call["index"], delta=e.fragment))
        elif isinstance(e, CallEnd):
            call = self.calls.pop(e.index)
            item = call["item"]
            item["status"] = "completed" if e.complete else "incomplete"
            out.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                  output_index=call["index"], arguments=item["arguments"], name=item["name"]))
            out.append(self.event("response.output_item.done", output_index=call["index"], item=dict(item)))
        return out

    def close_message(self) -> list[bytes]:
        msg = self.message
        if msg is None:
            return []
        self.message = None
        index = msg.pop("index")
        msg["status"] = "completed"
        part = msg["content"][0]
        return [self.event("response.output_text.done", item_id=msg["id"], output_index=index, content_index=0,
                           text=part["text"], logprobs=[]),
                self.event("response.content_part.done", item_id=msg["id"], output_index=index, content_index=0,
                           part={"type": "output_text", "text": part["text"], "annotations": []}),
                self.event("response.output_item.done", output_index=index, item=dict(msg))]


def add_responses_routes(app: FastAPI, serving_of: Callable[[Request], ResponsesServing]) -> None:
    @app.post("/v1/responses")
    async def create_response(request: Request):
        body = await parse_body(request, ResponsesRequest)
        return await serving_of(request).create(body, request.receive)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str, request: Request):
        return ORJSONResponse(serving_of(request).retrieve(response_id))

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str, request: Request):
        return ORJSONResponse(serving_of(request).cancel(response_id))

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request):
        return ORJSONResponse(serving_of(request).delete(response_id))
