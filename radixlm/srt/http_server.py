"""The HTTP server: a FastAPI app over one TokenizerManager, served by uvicorn.

    radixlm serve --model-path DIR --port 30000

`launch_server` starts the scheduler and detokenizer processes first, then uvicorn; the
TokenizerManager is created in the app's lifespan, on uvicorn's own event loop (its ZMQ
sockets and asyncio objects belong to that loop). On SIGINT/SIGTERM uvicorn drains: every
request is aborted first so streams end at once, then the processes are stopped and the
IPC directory removed.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from pydantic import ValidationError

from radixlm.config import ServerArgs
from radixlm.srt.http_auth import AuthMiddleware, is_loopback_bind
from radixlm.srt.http_limits import BodyGuard, header_timeout_protocol
from radixlm.srt.http_rl_routes import RL_REQUEST_BODIES, add_rl_routes
from radixlm.srt.http_tokenize_routes import TOKENIZE_REQUEST_BODIES, add_tokenize_routes
from radixlm.srt.http_utils import (SSE_DONE, ClientDisconnected, HTTPError, ORJSONResponse, SSEResponse,
                                    abort_error, declare_request_bodies, error_body, error_response,
                                    next_or_disconnect, parse_body, sse_event)
from radixlm.srt.http_worker_routes import add_worker_routes
from radixlm.srt.openai_responses import ResponsesServing, add_responses_routes
from radixlm.srt.responses_protocol import ResponsesRequest
from radixlm.srt.launch import describe as describe_process
from radixlm.srt.served_name import default_served_model_name
from radixlm.srt.openai_protocol import (AbortRequest, ChatCompletionRequest, CloseSessionRequest,
                                         CompletionRequest, GenerateRequest, OpenSessionRequest, PauseRequest)
from radixlm.validation import describe

logger = logging.getLogger(__name__)

HEALTH_CHECK_RID_PREFIX = "HEALTH_CHECK_"
HEALTH_CHECK_TIMEOUT_S = 20.0
# Uvicorn waits this long for in-flight requests after the abort-all on shutdown.
GRACEFUL_SHUTDOWN_S = 5
SHUTDOWN_MESSAGE = "the server is shutting down"
# Request line + headers (h11 answers 400 beyond).
MAX_HEADER_BYTES = 64 * 1024
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


# What each route's JSON body is (parsed by parse_body; declared in /openapi.json).
REQUEST_BODIES = {("POST", "/v1/completions"): CompletionRequest, ("POST", "/v1/chat/completions"): ChatCompletionRequest,
                  ("POST", "/generate"): GenerateRequest, ("POST", "/abort_request"): AbortRequest,
                  ("POST", "/pause_generation"): PauseRequest, ("POST", "/v1/responses"): ResponsesRequest,
                  ("POST", "/open_session"): OpenSessionRequest, ("POST", "/close_session"): CloseSessionRequest,
                  **RL_REQUEST_BODIES, **TOKENIZE_REQUEST_BODIES}


@dataclass
class ServerContext:
    """What the handlers share; `tm` and `openai` exist once the lifespan has started."""
    args: ServerArgs
    procs: Any  # RuntimeProcesses
    served_model_name: str | None = None
    tm: Any = None
    openai: Any = None
    responses: Any = None  # ResponsesServing (/v1/responses)
    shutting_down: bool = False
    dead_child: str | None = None  # which runtime process exited while we were serving, and how


def _ctx(request: Request) -> ServerContext:
    return request.app.state.ctx


# ---------------------------------------------------------------------------- app
def create_app(args: ServerArgs, procs, served_model_name: str | None = None) -> FastAPI:
    ctx = ServerContext(args, procs, served_model_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        from radixlm.srt.gc_watch import GCWatch, freeze_startup_heap
        from radixlm.srt.openai_serving import OpenAIServing
        from radixlm.srt.tokenizer_manager import TokenizerManager

        ctx.tm = TokenizerManager(args, procs.ports, procs.scheduler_info)
        ctx.tm.start()
        ctx.served_model_name = ctx.served_model_name or default_served_model_name(ctx.tm.model_path)
        ctx.openai = OpenAIServing(ctx.tm, ctx.served_model_name)
        ctx.responses = ResponsesServing(ctx.openai, args.max_stored_responses)
        ctx.tm.metrics.model_name = ctx.served_model_name  # the sglang: metrics' model_name label
        _watch_children(ctx, asyncio.get_running_loop())
        # only `radixlm serve` creates this app: the process is ours (an Engine's never is)
        freeze_startup_heap()
        gc_watch = GCWatch(args.gc_warning_threshold_secs).install()
        try:
            yield
        finally:
            ctx.shutting_down = True
            ctx.tm.shut_down(SHUTDOWN_MESSAGE)
            await ctx.openai.chat_templates.aclose()
            await ctx.tm.close()
            gc_watch.uninstall()

    app = FastAPI(title="radixlm", default_response_class=ORJSONResponse, lifespan=lifespan,
                  docs_url=None, redoc_url=None)
    app.state.ctx = ctx
    app.state.max_json_nesting = args.max_json_nesting
    _add_error_handlers(app)
    _add_openai_routes(app)
    _add_native_routes(app)
    add_rl_routes(app, lambda request: _ctx(request).tm)
    add_tokenize_routes(app, _ctx)
    add_worker_routes(app, _ctx)
    add_responses_routes(app, lambda request: _ctx(request).responses)
    declare_request_bodies(app, REQUEST_BODIES)
    # the last added runs first: keys and origins are checked before any body is read
    app.add_middleware(BodyGuard, max_bytes=args.max_payload_size, timeout_s=args.http_body_timeout)
    app.add_middleware(AuthMiddleware, api_key=args.api_key, admin_api_key=args.admin_api_key,
                       bind_host=args.host, allowed_hosts=args.allowed_hosts)
    return app


def _watch_children(ctx: ServerContext, loop: asyncio.AbstractEventLoop) -> None:
    """If the scheduler or detokenizer dies, nothing would ever answer again: shut the
    server down (non-zero exit) instead of hanging every request. One daemon thread per
    child blocks in waitpid, so there is no polling and nothing delays the exit."""
    def on_exit(name: str, code: int | None) -> None:
        if ctx.shutting_down:
            return
        what = describe_process(name)
        logger.error("the %s exited unexpectedly (code %s); shutting down", what, code)
        ctx.dead_child = f"{what} died (exit code {code})"
        ctx.tm.fail_all(f"the {what} exited unexpectedly (code {code})")
        signal.raise_signal(signal.SIGTERM)  # uvicorn's graceful exit path

    def wait(name: str, proc) -> None:
        code = proc.wait()
        if code == 0:
            # A child exits 0 only on SIGTERM. A stop sent to the whole process group
            # (systemd, docker, `timeout`) reaches us too: give our own handler a moment to
            # begin the orderly shutdown before calling this a crash.
            deadline = time.monotonic() + 1.0
            while not ctx.shutting_down and time.monotonic() < deadline:
                time.sleep(0.02)
        try:
            loop.call_soon_threadsafe(on_exit, name, code)
        except RuntimeError:  # the loop is already closed: we are exiting anyway
            pass

    for name, proc in ctx.procs.procs.items():
        threading.Thread(target=wait, args=(name, proc), name=f"radixlm-watch-{name}", daemon=True).start()


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        # FastAPI says 422; OpenAI clients (and our contract) expect 400 for any bad body.
        message, param = describe(list(exc.errors()))
        return error_response(message, 400, param)

    @app.exception_handler(HTTPError)
    async def _http_error(request: Request, exc: HTTPError):
        return error_response(exc.message, exc.status, exc.param)

    @app.exception_handler(ValueError)
    async def _value_error(request: Request, exc: ValueError):
        if isinstance(exc, ValidationError):  # pydantic's, raised outside parse_body
            message, param = describe(exc)
            return error_response(message, 400, param)
        return error_response(str(exc), 400)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        # Last resort (the traceback is logged by Starlette): JSON like every other error.
        return error_response(f"internal error: {type(exc).__name__}", 500)

    @app.exception_handler(StarletteHTTPException)
    async def _starlette(request: Request, exc: StarletteHTTPException):
        return error_response(str(exc.detail), exc.status_code)

    @app.exception_handler(ClientDisconnected)
    async def _gone(request: Request, exc: ClientDisconnected):
        return Response(status_code=499)  # nobody reads it; nginx's "client closed request"


# ---------------------------------------------------------------------------- OpenAI
def _add_openai_routes(app: FastAPI) -> None:
    @app.get("/v1/models")
    async def list_models(request: Request):
        return ORJSONResponse(_ctx(request).openai.models().model_dump())

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str, request: Request):
        serving = _ctx(request).openai
        serving.check_model(model)
        return ORJSONResponse(serving.models().data[0].model_dump())

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await parse_body(request, CompletionRequest)
        return await _ctx(request).openai.create_completion(body, request.receive)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await parse_body(request, ChatCompletionRequest)
        return await _ctx(request).openai.create_chat_completion(body, request.receive)


# ---------------------------------------------------------------------------- native
def _add_native_routes(app: FastAPI) -> None:
    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request):
        body = await parse_body(request, GenerateRequest)
        tm = _ctx(request).tm
        agen = tm.generate_request(**body.generate_kwargs())
        if not body.stream:
            try:
                out = await next_or_disconnect(agen, request.receive)
            finally:
                await agen.aclose()
            for r in out if isinstance(out, list) else [out]:
                err = abort_error(r["meta_info"])
                if err is not None:
                    return error_response(err[1], err[0])
            return ORJSONResponse(out)
        # An error before anything is streamed (bad input 400, full queue 503, ...) is a plain
        # HTTP error: a gateway retries a 503 on another worker only if it sees the status.
        first = await next_or_disconnect(agen, request.receive)
        err = abort_error(first["meta_info"])
        if err is not None:
            await agen.aclose()
            return error_response(err[1], err[0])
        return SSEResponse(_cumulative_events(first, agen))

    @app.post("/abort_request")
    async def abort_request(request: Request):
        body = await parse_body(request, AbortRequest)
        # The callers hit are answered now; an unknown rid hits 0 and leaves a tombstone.
        n = _ctx(request).tm.abort_request(body.rid, body.abort_all, body.prefix)
        return ORJSONResponse({"success": True, "num_aborted": n})

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(request: Request, timeout: float = 1.0):
        # A short grace: requests that were just aborted may need a scheduler step to drain.
        if await _ctx(request).tm.flush_cache(timeout=max(0.0, timeout)):
            return Response("Cache flushed.\n", status_code=200)
        return Response("Cache not flushed: requests are still running.\n", status_code=400)

    @app.post("/pause_generation")
    async def pause_generation(request: Request):
        body = await parse_body(request, PauseRequest)
        await _ctx(request).tm.pause_generation(body.mode)
        return ORJSONResponse({"success": True})

    @app.post("/open_session")
    async def open_session(request: Request):
        body = await parse_body(request, OpenSessionRequest)
        try:
            sid = await _ctx(request).tm.open_session(body.capacity_of_str_len, body.session_id, body.timeout)
        except ValueError as e:
            return error_response(str(e), 400)
        return ORJSONResponse(sid)  # SGLang answers the id as a JSON string

    @app.post("/close_session")
    async def close_session(request: Request):
        body = await parse_body(request, CloseSessionRequest)
        try:
            await _ctx(request).tm.close_session(body.session_id)
        except ValueError as e:
            return error_response(str(e), 400)
        return ORJSONResponse({"success": True})

    @app.post("/continue_generation")
    async def continue_generation(request: Request):
        await _ctx(request).tm.continue_generation()
        return ORJSONResponse({"success": True})

    @app.get("/health")
    async def health(request: Request):
        ctx = _ctx(request)
        if ctx.shutting_down or not ctx.procs.alive():
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate(request: Request):
        ctx = _ctx(request)
        if ctx.shutting_down or not ctx.procs.alive():
            return Response(status_code=503)
        return Response(status_code=200 if await _health_generate(ctx.tm) else 503)

    @app.get("/metrics")
    async def metrics(request: Request):
        tm = _ctx(request).tm
        return Response(tm.metrics.render(await tm.get_server_info()), media_type=METRICS_CONTENT_TYPE)


async def _cumulative_events(first: dict, agen) -> AsyncIterator[bytes]:
    """/generate streaming as SGLang does it: each chunk carries the CUMULATIVE text,
    output_ids and output logprobs so far (per `index` when n > 1)."""
    acc: dict[int, dict] = {}
    try:
        chunk = first
        while chunk is not None:
            err = abort_error(chunk["meta_info"])
            if err is not None:
                yield sse_event(error_body(err[1], err[0]))
                break
            i = chunk.get("index", 0)
            a = acc.setdefault(i, {"text": "", "output_ids": [], "lps": [], "tops": [], "asked": []})
            a["text"] += chunk.get("text", "")
            a["output_ids"].extend(chunk["output_ids"])
            meta = dict(chunk["meta_info"])
            if "output_token_logprobs" in meta:
                a["lps"].extend(meta["output_token_logprobs"] or [])
                a["tops"].extend(meta["output_top_logprobs"] or [])
                meta["output_token_logprobs"], meta["output_top_logprobs"] = a["lps"], a["tops"]
            if "output_token_ids_logprobs" in meta:
                a["asked"].extend(meta["output_token_ids_logprobs"] or [])
                meta["output_token_ids_logprobs"] = a["asked"]
            out = {"text": a["text"], "output_ids": a["output_ids"], "meta_info": meta}
            if "text" not in chunk:  # skip_tokenizer_init: ids only
                del out["text"]
            if "index" in chunk:
                out["index"] = i
            yield sse_event(out)
            try:
                chunk = await agen.__anext__()
            except StopAsyncIteration:
                chunk = None
    except Exception as e:  # headers already sent: report in-band
        logger.exception("/generate stream failed")
        yield sse_event(error_body(f"{type(e).__name__}: {e}", 400 if isinstance(e, ValueError) else 500))
    finally:
        await agen.aclose()
    yield SSE_DONE


async def _health_generate(tm) -> bool:
    """Healthy if the runtime produces output: when requests are running, any output within
    the timeout proves it; when idle, a 1-token generation must complete."""
    start = time.time()
    if tm.states:
        while time.time() - start < HEALTH_CHECK_TIMEOUT_S:
            if tm.last_receive_time > start:
                return True
            await asyncio.sleep(0.1)
        return False
    agen = tm.generate_request(input_ids=[0], sampling_params={"max_new_tokens": 1, "ignore_eos": True},
                               rid=f"{HEALTH_CHECK_RID_PREFIX}{uuid.uuid4().hex}")
    try:
        out = await asyncio.wait_for(agen.__anext__(), HEALTH_CHECK_TIMEOUT_S)
        return abort_error(out["meta_info"]) is None
    except Exception:
        logger.exception("health generation failed")
        return False
    finally:
        await agen.aclose()


# ---------------------------------------------------------------------------- launch
def _make_uvicorn_server(app: FastAPI, args: ServerArgs):
    import uvicorn

    class Server(uvicorn.Server):
        """Prints the ready line; aborts every request when shutdown starts (uvicorn would
        otherwise wait for streams to end by themselves); does not re-raise the signal after
        exiting (with SIGTERM's default action that would kill us before cleanup)."""

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started:
                port = self.servers[0].sockets[0].getsockname()[1] if self.servers else args.port
                ctx: ServerContext = app.state.ctx
                print(f"radixlm: ready: serving {ctx.served_model_name!r} at http://{args.host}:{port} "
                      f"(pid {os.getpid()})", flush=True)

        async def shutdown(self, sockets=None) -> None:
            ctx: ServerContext = app.state.ctx
            ctx.shutting_down = True
            if ctx.tm is not None:  # every caller is answered now (503), wherever its request is
                ctx.tm.shut_down(SHUTDOWN_MESSAGE)
            getattr(self, "_captured_signals", []).clear()
            await super().shutdown(sockets)

    verbose = args.log_level in ("debug", "info")
    config = uvicorn.Config(app, host=args.host, port=args.port, loop="uvloop", log_level=args.log_level,
                            access_log=verbose, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
                            timeout_keep_alive=30, http=header_timeout_protocol(args.http_header_timeout),
                            h11_max_incomplete_event_size=MAX_HEADER_BYTES)
    return Server(config)


def _raise_system_exit(signum: int, frame) -> None:
    raise SystemExit(128 + signum)


def launch_server(args: ServerArgs, served_model_name: str | None = None) -> None:
    """Start the runtime processes and serve HTTP until SIGINT/SIGTERM; always stops the
    processes and removes the IPC directory before returning."""
    from radixlm.srt.launch import launch_subprocesses

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s [http] %(levelname)s %(name)s: %(message)s")
    if not is_loopback_bind(args.host) and not (args.api_key or args.admin_api_key):
        logger.warning("serving on %s without --api-key: anyone who reaches the port can generate, "
                       "pause, reload weights and abort everything", args.host)
    # Until uvicorn installs its handlers (and after it restores them), SIGTERM must unwind
    # through the `finally` below instead of killing the process with the children's IPC
    # directory left behind.
    previous = signal.signal(signal.SIGTERM, _raise_system_exit)
    procs = None
    try:
        procs = launch_subprocesses(args)
        app = create_app(args, procs, served_model_name)
        server = _make_uvicorn_server(app, args)
        from radixlm.srt.cpu_priority import front_end_thread
        front_end_thread(args.scheduler_policy)  # after the children started: they keep the normal policy
        server.run()
        if not server.started:
            raise SystemExit("the HTTP server failed to start (is the port in use?)")
        if app.state.ctx.dead_child:
            # exit status 1: a supervisor restarts the server (docs/error_boundary.md, "Crash policy")
            raise SystemExit(f"radixlm: stopped: the {app.state.ctx.dead_child}; every request in flight was "
                             "answered with a 500; restart the server")
    except KeyboardInterrupt:
        pass
    finally:
        if procs is not None:
            procs.shutdown()
        signal.signal(signal.SIGTERM, previous)
        sys.stdout.flush()
