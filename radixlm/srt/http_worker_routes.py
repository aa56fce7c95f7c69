"""The endpoints a fleet gateway reads on a worker: server and model info, load.

What the SGLang Model Gateway (`smg`, checked with 1.13) calls on an HTTP worker, and what
answers it here (docs/fleet.md has the whole contract, RL fan-out and stop path included):

- registration: `GET /health`, `GET /v1/models`, `GET /version`, `GET /server_info`,
  `GET /model_info` (falling back to the `/get_*` names on a 404). The engine is read off
  `/v1/models` `owned_by` ("sglang"/"vllm"), else `/version` answering means vLLM, else
  `/server_info` answering means SGLang. radixlm says `owned_by: "radixlm"` and has no
  `/version` on purpose, so it registers as an SGLang engine: SGLang's control routes and
  RL capabilities are the ones radixlm implements.
- health: `GET /health` every `--health-check-interval-secs`.
- load: `GET /v1/loads?include=...` (SGLang's shape), falling back to `/metrics`; older
  routers poll `GET /get_load`. Both are answered here.
- `/server_info` is SGLang's flat shape (the fields the gateway turns into worker labels at
  the top level); `/get_server_info` is the same document, as in SGLang.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import time
from typing import Callable

from fastapi import FastAPI, Request

from radixlm.srt.http_auth import auth_of
from radixlm.srt.http_utils import ORJSONResponse
from radixlm.srt.metrics_sglang import DecodeRate
from radixlm.version import __version__ as RADIXLM_VERSION


async def server_info(ctx, admin: bool = True) -> dict:
    """The worker's server info: the runtime's state, the server args both nested (radixlm's
    `server_args`) and as SGLang's top-level fields, and (for admins) this process's runtime
    pids. Secrets never; file system paths only for admins."""
    tm, args = ctx.tm, ctx.args
    info = await tm.get_server_info()
    info["server_args"] = public_server_args(args)
    info["served_model_name"] = ctx.served_model_name
    if admin:  # paths and pids only for whoever may use the control routes
        info["runtime"] = {"pid": os.getpid(), "ipc_dir": ctx.procs.ports.dir,
                           "child_pids": {k: p.pid for k, p in ctx.procs.procs.items()}}
    # One engine per worker: a `radixlm serve --dp-size N` fleet registers N workers of
    # dp_size 1 (a dp_size > 1 here would make a dp-aware gateway address ranks we lack).
    info.update(model_path=tm.model_path, tokenizer_path=tm.tokenizer_path,
                version=RADIXLM_VERSION, tp_size=args.tp_size, dp_size=1, pp_size=1, is_embedding=False,
                context_length=tm.context_len, max_total_tokens=info["memory"]["capacity"],
                page_size=args.page_size, max_prefill_tokens=args.max_prefill_tokens)
    return info if admin else redact_paths(info)


# Server args that are secrets or local paths: never in /get_server_info.
SECRET_ARGS = ("api_key", "admin_api_key")
PATH_ARGS = ("model_path", "tokenizer_path")


def public_server_args(args) -> dict:
    d = dataclasses.asdict(args)
    for name in SECRET_ARGS:
        if d.get(name) is not None:
            d[name] = "<set>"
    return d


def redact_paths(info: dict) -> dict:
    """/get_server_info for callers without admin access: no file system paths."""
    info = dict(info)
    info["server_args"] = {k: (None if k in PATH_ARGS else v) for k, v in info["server_args"].items()}
    for k in PATH_ARGS:
        info.pop(k, None)
    return info


def model_info(ctx, admin: bool = True) -> dict:
    """SGLang's model info, with the sampling defaults read from the model's generation config;
    file system paths only for admins (as in server_info)."""
    tm = ctx.tm
    info = {"model_path": tm.model_path, "tokenizer_path": tm.tokenizer_path,
            "is_generation": True, "context_length": tm.context_len, "vocab_size": tm.vocab_size,
            "served_model_name": ctx.served_model_name, "weight_version": tm.weight_version,
            "default_sampling_params": dict(getattr(tm, "sampling_defaults", {})),
            "has_image_understanding": False, "has_audio_understanding": False}
    if not admin:
        for k in PATH_ARGS:
            info.pop(k)
    return info


def load_snapshot(info: dict, throughput: float) -> dict:
    """One rank's load in SGLang's `/v1/loads` core fields (`utilization` is 0, as SGLang's)."""
    mem = info["memory"]
    used = mem["capacity"] - mem["free"] - mem["evictable"]  # held by requests, not by the cache
    waiting_tokens = info.get("num_waiting_tokens", 0)
    computed = info.get("num_prefill_tokens", 0) + info.get("num_cached_tokens", 0)
    return {"dp_rank": 0, "num_running_reqs": info["num_running_reqs"],
            "num_waiting_reqs": info["num_waiting_reqs"],
            "num_total_reqs": info["num_running_reqs"] + info["num_waiting_reqs"],
            # an upper bound: the waiting requests' prefix matches are only known at admission
            "num_waiting_uncached_tokens": waiting_tokens,
            "num_used_tokens": used, "num_total_tokens": used + waiting_tokens,
            "max_total_num_tokens": mem["capacity"],
            "max_running_requests": info.get("max_running_requests", 0),
            "token_usage": round(used / max(mem["capacity"], 1), 4),
            "gen_throughput": round(throughput, 2),
            "cache_hit_rate": round(info.get("num_cached_tokens", 0) / computed, 4) if computed else 0.0,
            "utilization": 0.0,
            "memory": dict(mem)}


def add_worker_routes(app: FastAPI, ctx_of: Callable[[Request], object]) -> None:
    throughput = DecodeRate()  # between this worker's load polls

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def get_server_info(request: Request):
        return ORJSONResponse(await server_info(ctx_of(request), admin=auth_of(request).admin))

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def get_model_info(request: Request):
        return ORJSONResponse(model_info(ctx_of(request), admin=auth_of(request).admin))

    @app.get("/v1/loads")
    async def loads(request: Request, include: str = "core"):
        info = await ctx_of(request).tm.get_server_info()
        load = load_snapshot(info, throughput.update(info.get("num_decode_tokens", 0)))
        if "memory" not in include.split(","):
            load.pop("memory")
        return ORJSONResponse({"timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                               "version": RADIXLM_VERSION, "dp_rank_count": 1, "loads": [load]})

    @app.get("/get_load")
    async def get_load(request: Request):
        """The older routers' shape: one entry per data-parallel rank."""
        info = await ctx_of(request).tm.get_server_info()
        load = load_snapshot(info, throughput.value)
        return ORJSONResponse([{"dp_rank": 0, "num_reqs": load["num_total_reqs"],
                                "num_waiting_reqs": load["num_waiting_reqs"],
                                "num_tokens": load["num_total_tokens"],
                                "num_pending_tokens": load["num_waiting_uncached_tokens"],
                                "ts_tic": time.perf_counter()}])
