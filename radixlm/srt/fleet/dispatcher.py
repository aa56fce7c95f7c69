"""radixlm's built-in router for `radixlm serve --dp-size N` where `smg` is not installed.

    python -m radixlm.srt.fleet.dispatcher --worker-urls URL... --port 30000 [--policy prefix_hash]

It is deliberately small: the SGLang Model Gateway is the fleet router (cache-aware radix
trees, retries, circuit breaking, health checks). This keeps `--dp-size` working without it,
with the same HTTP API as one server:

- generation (`/generate`, `/v1/completions`, `/v1/chat/completions`) goes to one replica:
  `prefix_hash` sends requests whose first PREFIX_CHARS characters (or PREFIX_IDS token ids)
  agree to the same replica, so a shared system prompt or an earlier turn of a chat is a
  prefix-cache hit there, unless that replica has BALANCE_SLACK more requests in flight than
  the least busy one; `round_robin` alternates. A request that names its replica
  (`routed_dp_rank` or `data_parallel_rank`, SGLang's fields) goes there. `/v1/responses`
  (streamed like the others) and its stored-response routes go to the first replica, which
  keeps the stored responses `previous_response_id` continues.
- the stop path: a client that disconnects closes the upstream request, which the replica
  aborts at once; a replica that dies mid-stream ends the stream with an in-band error.
- control routes (abort, pause/continue, cache flush, weight updates, memory) fan out to
  every replica and answer once; info routes answer from the first replica, `/health` is
  200 only when every replica is healthy. Other paths go to the first replica.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import zlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import orjson
from fastapi import FastAPI, Request
from starlette.responses import Response

from radixlm.srt.http_utils import (SSE_DONE, ClientDisconnected, ORJSONResponse, SSEResponse, await_or_disconnect,
                                    error_body, error_response, sse_event)

logger = logging.getLogger(__name__)

PREFIX_CHARS = 256
PREFIX_IDS = 64
BALANCE_SLACK = 4
POLICIES = ("prefix_hash", "round_robin")
GENERATION_ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions")
RESPONSES_ROUTE = "/v1/responses"
FAN_OUT_ROUTES = ("/abort_request", "/pause_generation", "/continue_generation", "/flush_cache",
                  "/update_weights_from_disk", "/update_weights_from_tensor", "/update_weight_version",
                  "/release_memory_occupation", "/resume_memory_occupation")
# the fields by which a client picks the replica (SGLang's names)
DP_RANK_FIELDS = ("routed_dp_rank", "data_parallel_rank")
FORWARDED_HEADERS = ("authorization", "content-type", "x-request-id")


def routing_key(body: Any) -> str | None:
    """The start of the prompt, as text: what decides which replica's cache it can hit."""
    if not isinstance(body, dict):
        return None
    for name in ("text", "prompt"):
        v = body.get(name)
        if isinstance(v, str):
            return v[:PREFIX_CHARS]
        if isinstance(v, list) and v and isinstance(v[0], int):
            return ",".join(map(str, v[:PREFIX_IDS]))
        if isinstance(v, list) and v:  # a batch: route by its first prompt
            return routing_key({name: v[0]})
    ids = body.get("input_ids")
    if isinstance(ids, list) and ids:
        return routing_key({"prompt": ids[0] if isinstance(ids[0], list) else ids})
    messages = body.get("messages")
    if isinstance(messages, list):
        return orjson.dumps(messages)[:PREFIX_CHARS].decode(errors="ignore")
    return None


def requested_rank(body: Any, n: int) -> int | None:
    """The replica the client chose (SGLang's routed_dp_rank, or its older name
    data_parallel_rank), or None. ValueError for a rank that is not one of the n replicas."""
    if not isinstance(body, dict):
        return None
    given = {k: body[k] for k in DP_RANK_FIELDS if body.get(k) is not None}
    if len(set(map(repr, given.values()))) > 1:
        raise ValueError(f"routed_dp_rank and data_parallel_rank differ: {given}")
    for name, rank in given.items():
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < n:
            raise ValueError(f"{name} must be a replica's rank, an integer in [0, {n}), got {rank!r}")
        return rank
    return None


class Dispatcher:
    def __init__(self, urls: list[str], policy: str = "prefix_hash") -> None:
        if policy not in POLICIES:
            raise ValueError(f"the built-in dispatcher's policy must be one of {POLICIES}, got {policy!r}")
        self.urls = [u.rstrip("/") for u in urls]
        self.policy = policy
        self.inflight = [0] * len(self.urls)
        self._next = itertools.count()
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0),
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))

    def pick(self, body: Any) -> int:
        n = len(self.urls)
        least = min(range(n), key=lambda i: self.inflight[i])
        key = routing_key(body) if self.policy == "prefix_hash" else None
        if key is None:
            return next(self._next) % n if self.policy == "round_robin" else least
        i = zlib.crc32(key.encode()) % n
        return least if self.inflight[i] - self.inflight[least] > BALANCE_SLACK else i

    @staticmethod
    def headers(request: Request) -> dict[str, str]:
        return {k: v for k, v in request.headers.items() if k in FORWARDED_HEADERS}

    # ------------------------------------------------------------------ generation
    async def generate(self, request: Request) -> Response:
        raw = await request.body()
        try:
            body = orjson.loads(raw) if raw.strip() else {}
        except orjson.JSONDecodeError:
            body = None  # forwarded as is: the replica answers the 400
        try:
            rank = requested_rank(body, len(self.urls))
        except ValueError as e:
            return error_response(str(e), 400, "data_parallel_rank")
        if request.url.path == RESPONSES_ROUTE:
            i = 0  # stored responses (previous_response_id, GET, cancel) live on one replica
        elif rank is None:
            i = self.pick(body)
        else:  # the replica is one rank of its own: it gets the body without the field
            i = rank
            raw = orjson.dumps({k: v for k, v in body.items() if k not in DP_RANK_FIELDS})
        upstream = self.client.build_request(request.method, self.urls[i] + request.url.path, content=raw,
                                             params=request.query_params, headers=self.headers(request))
        self.inflight[i] += 1
        handed_off = False
        try:
            # Disconnect while waiting: the send is cancelled, the upstream connection closed,
            # and the replica aborts the request.
            resp = await await_or_disconnect(self.client.send(upstream, stream=True), request.receive)
            if resp.headers.get("content-type", "").startswith("text/event-stream"):
                handed_off = True
                return SSEResponse(self._relay(i, resp), status_code=resp.status_code)
            content = await await_or_disconnect(resp.aread(), request.receive)
            await resp.aclose()
            return Response(content, status_code=resp.status_code, media_type=resp.headers.get("content-type"))
        except httpx.HTTPError as e:
            return error_response(f"replica {self.urls[i]} failed: {type(e).__name__}: {e}", 502)
        finally:
            if not handed_off:
                self.inflight[i] -= 1

    async def _relay(self, i: int, resp: httpx.Response) -> AsyncIterator[bytes]:
        """The replica's stream, byte for byte; closing this closes the upstream request."""
        try:
            async for chunk in resp.aiter_raw():
                yield chunk
        except httpx.HTTPError as e:
            yield b"\n\n" + sse_event(error_body(f"replica {self.urls[i]} failed mid-stream: "
                                                 f"{type(e).__name__}: {e}", 502))
            yield SSE_DONE
        finally:
            self.inflight[i] -= 1
            await resp.aclose()

    # ------------------------------------------------------------------ fan-out
    async def _call(self, url: str, request: Request, raw: bytes) -> dict:
        try:
            r = await self.client.request(request.method, url + request.url.path, content=raw,
                                          params=request.query_params, headers=self.headers(request))
        except httpx.HTTPError as e:
            return {"url": url, "status": 502, "body": f"{type(e).__name__}: {e}"}
        try:
            body: Any = r.json()
        except ValueError:
            body = r.text
        return {"url": url, "status": r.status_code, "body": body}

    async def fan_out(self, request: Request) -> Response:
        raw = await request.body()
        results = await asyncio.gather(*(self._call(u, request, raw) for u in self.urls))
        failed = [r for r in results if not 200 <= r["status"] < 300]
        bodies = [r["body"] for r in results if isinstance(r["body"], dict)]
        merged: dict[str, Any] = {"success": not failed, "replicas": results}
        if request.url.path == "/abort_request":
            merged["num_aborted"] = sum(b.get("num_aborted", 0) for b in bodies)
        versions = {b.get("weight_version") for b in bodies if "weight_version" in b}
        if len(versions) == 1:
            merged["weight_version"] = versions.pop()
        status = failed[0]["status"] if failed else 200
        return ORJSONResponse(merged, status_code=status)

    # ------------------------------------------------------------------ info
    async def first(self, request: Request) -> Response:
        raw = await request.body()
        r = await self._call(self.urls[0], request, raw)
        if isinstance(r["body"], (dict, list)):
            return ORJSONResponse(r["body"], status_code=r["status"])
        return Response(str(r["body"]), status_code=r["status"])

    async def health(self, request: Request) -> Response:
        results = await asyncio.gather(*(self._call(u, request, b"") for u in self.urls))
        return Response(status_code=200 if all(r["status"] == 200 for r in results) else 503)

    async def server_info(self, request: Request) -> Response:
        results = await asyncio.gather(*(self._call(u, request, b"") for u in self.urls))
        return ORJSONResponse({"router": "builtin", "policy": self.policy, "dp_size": len(self.urls),
                               "inflight": self.inflight,
                               "replicas": [{"url": r["url"], "status": r["status"], "info": r["body"]}
                                            for r in results]})


def create_dispatcher_app(urls: list[str], policy: str = "prefix_hash") -> FastAPI:
    d = Dispatcher(urls, policy)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await d.client.aclose()

    app = FastAPI(title="radixlm dispatcher", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.dispatcher = d
    for path in (*GENERATION_ROUTES, RESPONSES_ROUTE):
        app.add_api_route(path, d.generate, methods=["POST", "PUT"] if path == "/generate" else ["POST"])
    for path in FAN_OUT_ROUTES:
        app.add_api_route(path, d.fan_out, methods=["GET", "POST"] if path == "/flush_cache" else ["POST"])
    for path in ("/health", "/health_generate"):
        app.add_api_route(path, d.health, methods=["GET"])
    for path in ("/server_info", "/get_server_info"):
        app.add_api_route(path, d.server_info, methods=["GET"])

    @app.get("/metrics")
    async def metrics() -> Response:
        return error_response("each replica has its own /metrics; their URLs are in /server_info", 404)

    app.add_api_route("/{path:path}", d.first, methods=["GET", "POST", "DELETE"])

    @app.exception_handler(ClientDisconnected)
    async def _gone(request: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)
    return app


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(prog="python -m radixlm.srt.fleet.dispatcher", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker-urls", nargs="+", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--policy", choices=POLICIES, default="prefix_hash")
    parser.add_argument("--log-level", default="warning")
    ns = parser.parse_args(argv)
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s [dispatcher] %(levelname)s %(message)s")
    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            # uvicorn re-raises a captured SIGTERM after its shutdown; a stop asked for is a clean exit
            getattr(self, "_captured_signals", []).clear()
            await super().shutdown(sockets)

    config = uvicorn.Config(create_dispatcher_app(ns.worker_urls, ns.policy), host=ns.host, port=ns.port,
                            log_level=ns.log_level, access_log=False, timeout_graceful_shutdown=5)
    Server(config).run()


if __name__ == "__main__":
    main()
