"""HTTP plumbing shared by the native and OpenAI endpoints: JSON/SSE responses, OpenAI-style
error bodies, and client-disconnect detection.

Disconnect handling is the point of this module. A request whose client went away must be
aborted at once (semantics §3), streaming or not, so every generation is raced against a
task that awaits the ASGI `http.disconnect` message; whichever finishes first wins, and the
loser is cancelled. Cancelling the task that awaits the TokenizerManager's async generator
raises CancelledError inside it, whose `finally` sends the abort to the scheduler
synchronously, so the abort leaves this process within one event-loop turn of the disconnect.
"""
from __future__ import annotations

import asyncio
import logging
import warnings
from typing import Any, AsyncIterator, Awaitable, Mapping, TypeVar

import orjson
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from radixlm.validation import check_nesting, describe

logger = logging.getLogger(__name__)

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)

# OpenAI's Python client names its exception classes after these; clients match on them.
ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
               404: "NotFoundError", 405: "MethodNotAllowedError", 409: "ConflictError",
               413: "RequestTooLargeError", 422: "UnprocessableEntityError", 429: "RateLimitError",
               500: "InternalServerError", 503: "ServiceUnavailableError"}

SSE_DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


class ORJSONResponse(JSONResponse):
    """JSON via orjson (FastAPI's own ORJSONResponse is deprecated and warns on import of use)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content, option=orjson.OPT_NON_STR_KEYS)


class HTTPError(Exception):
    """Raised by handlers; the app turns it into an OpenAI-style error response."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param


class ClientDisconnected(Exception):
    """The client closed the connection before the answer was ready (the work was aborted)."""


async def parse_body(request: Request, model: type[M]) -> M:
    """The JSON body as `model`, whatever the content type says (curl -d sends a form type),
    or HTTPError(400): malformed JSON, nesting deeper than --max-json-nesting and wrong field
    types are all client errors. The body's size was bounded before it was read
    (http_limits.BodyGuard)."""
    raw = await request.body()
    try:
        data = orjson.loads(raw) if raw.strip() else {}
    except orjson.JSONDecodeError as e:
        raise HTTPError(f"malformed JSON body: {e}") from e
    return body_as(data, model, getattr(request.app.state, "max_json_nesting", 64))


def body_as(data: Any, model: type[M], max_json_nesting: int = 64) -> M:
    """A parsed JSON body as `model`, or HTTPError(400) naming the bad field (the HTTP routes
    and `radixlm run-batch` check a body the same way)."""
    try:
        check_nesting(data, max_json_nesting, "the request body")
        return model.model_validate(data)
    except ValidationError as e:
        message, param = describe(e)
        raise HTTPError(message, param=param) from e
    except ValueError as e:
        raise HTTPError(str(e)) from e


def error_body(message: str, status: int = 400, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "APIError"),
                      "param": param, "code": status}}


def error_response(message: str, status: int = 400, param: str | None = None) -> ORJSONResponse:
    return ORJSONResponse(error_body(message, status, param), status_code=status)


def abort_error(meta: Mapping[str, Any]) -> tuple[int, str] | None:
    """(HTTP status, message) when a result ended with an error abort (status >= 400, e.g. a
    timeout or a full queue → 503); None for success and for a user abort (status 200)."""
    fr = meta.get("finish_reason")
    if not fr or fr.get("type") != "abort":
        return None
    code = fr.get("status_code")
    if code is None or not 400 <= int(code) < 600:
        return None
    return int(code), str(fr.get("message") or "request aborted")


def sse_event(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS) + b"\n\n"


# ---------------------------------------------------------------------------- disconnects
async def wait_for_disconnect(receive: Receive) -> None:
    """Returns when the client disconnects. The request body has already been read, so the
    server only wakes this up on disconnect (or when the response is complete); no polling."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _cancel_and_wait(task: asyncio.Future) -> None:
    if not task.done():
        task.cancel()
    # Waiting lets the cancelled generator run its `finally` (the abort) before we go on.
    await asyncio.gather(task, return_exceptions=True)


async def await_or_disconnect(work: Awaitable[T], receive: Receive) -> T:
    """Await `work` unless the client disconnects first; then cancel it (which aborts the
    request it was waiting on) and raise ClientDisconnected."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        done, _ = await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        # Also runs when this handler itself is cancelled (server shutdown).
        await _cancel_and_wait(watcher)
        if not task.done():
            await _cancel_and_wait(task)
    if task in done:
        return task.result()
    raise ClientDisconnected()


async def next_or_disconnect(agen: AsyncIterator[T], receive: Receive) -> T:
    """The generator's next item, or ClientDisconnected (after closing the generator)."""
    try:
        return await await_or_disconnect(agen.__anext__(), receive)
    except ClientDisconnected:
        await agen.aclose()
        raise


class SSEResponse(Response):
    """A text/event-stream response that stops, and closes its event iterator, the moment the
    client disconnects, instead of when the next event fails to send (or never, with h11:
    uvicorn silently drops writes to a closed connection)."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], status_code: int = 200) -> None:
        self.events = events
        self.status_code = status_code
        self.background = None
        self.init_headers(SSE_HEADERS)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        pump = asyncio.ensure_future(self._pump(send))
        watcher = asyncio.ensure_future(wait_for_disconnect(receive))
        try:
            done, _ = await asyncio.wait((pump, watcher), return_when=asyncio.FIRST_COMPLETED)
            if pump in done:
                pump.result()
            else:
                logger.debug("client disconnected during a stream; aborting")
        finally:
            await _cancel_and_wait(watcher)
            await _cancel_and_wait(pump)
            # If the pump was cancelled in send(), the iterator is parked at a yield; closing
            # it runs its `finally` (which closes and so aborts the generation).
            await self.events.aclose()

    async def _pump(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for chunk in self.events:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def merge_streams(gens: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Interleave several async generators as (source index, item), in arrival order.
    Closing the merged stream cancels and closes every source (aborting their requests)."""
    if len(gens) == 1:
        try:
            async for item in gens[0]:
                yield 0, item
        finally:
            await gens[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(i: int, gen: AsyncIterator[T]) -> None:
        try:
            async for item in gen:
                queue.put_nowait((i, item, None))
            queue.put_nowait((i, end, None))
        except Exception as e:  # surfaced in the consumer
            queue.put_nowait((i, end, e))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    try:
        live = len(gens)
        while live:
            i, item, exc = await queue.get()
            if exc is not None:
                raise exc
            if item is end:
                live -= 1
                continue
            yield i, item
    finally:
        for t in tasks:
            await _cancel_and_wait(t)
        for g in gens:
            await g.aclose()


# ---------------------------------------------------------------------------- OpenAPI
def declare_request_bodies(app, bodies: dict) -> None:
    """Declare each route's JSON body in /openapi.json. The handlers parse bodies themselves
    (parse_body: any content type, 400 not 422), so FastAPI cannot see them; this adds
    `bodies[(method, path)]`'s schema to those operations (for clients and fuzzers)."""
    from fastapi.openapi.utils import get_openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            with warnings.catch_warnings():  # routes with two methods share an operation id: harmless
                warnings.simplefilter("ignore", UserWarning)
                schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for (method, path), model in bodies.items():
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
                op = schema["paths"][path][method.lower()]
                op["requestBody"] = {"required": True, "content": {"application/json": {
                    "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
