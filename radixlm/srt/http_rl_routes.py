"""HTTP endpoints of the RL API: weight updates and reads, weight versions, memory hand-back.

All of them are control routes (http_auth.ADMIN_ROUTES). A failed load from disk tells
why (no such path, no config.json, not a .gguf, ...) only to a caller that authenticated
with the admin key: otherwise the route would let anyone probe the file system.
"""
from __future__ import annotations

import logging
from typing import Callable

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field

from radixlm.srt.http_auth import auth_of
from radixlm.srt.http_utils import ORJSONResponse, error_body, parse_body
from radixlm.srt.weight_serialization import deserialize_named_tensors

logger = logging.getLogger(__name__)

STRICT = ConfigDict(strict=True)


class UpdateFromTensorBody(BaseModel):
    model_config = STRICT
    serialized_named_tensors: str
    flush_cache: bool = True
    weight_version: str | None = None


class UpdateFromDiskBody(BaseModel):
    model_config = STRICT
    model_path: str
    flush_cache: bool = True
    weight_version: str | None = None


class InitWeightsUpdateGroupBody(BaseModel):
    model_config = STRICT
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class UpdateFromDistributedBody(BaseModel):
    model_config = STRICT
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    weight_version: str | None = None
    abort_all_requests: bool = False


class DestroyWeightsUpdateGroupBody(BaseModel):
    model_config = STRICT
    group_name: str = "weight_update_group"


class GetWeightsBody(BaseModel):
    model_config = STRICT
    name: str
    truncate_size: int = Field(default=100, ge=1)


class WeightVersionBody(BaseModel):
    model_config = STRICT
    new_version: str


RL_REQUEST_BODIES = {("POST", "/update_weights_from_tensor"): UpdateFromTensorBody,
                     ("POST", "/update_weights_from_disk"): UpdateFromDiskBody,
                     ("POST", "/get_weights_by_name"): GetWeightsBody,
                     ("POST", "/update_weight_version"): WeightVersionBody,
                     ("POST", "/init_weights_update_group"): InitWeightsUpdateGroupBody,
                     ("POST", "/update_weights_from_distributed"): UpdateFromDistributedBody,
                     ("POST", "/destroy_weights_update_group"): DestroyWeightsUpdateGroupBody}


def weight_update_reply(res: dict | None, error: str | None = None) -> ORJSONResponse:
    """SGLang's answer to a weight update, {success, message, ...}: 200, or 400 on failure (the
    failure also carries the OpenAI-style `error` object the other routes answer with)."""
    if error is not None:
        return ORJSONResponse({"success": False, "message": error, **error_body(error)}, status_code=400)
    return ORJSONResponse({"success": True, "message": "Succeeded to update model weights.",
                           "num_paused_requests": 0, **(res or {})})


def add_rl_routes(app: FastAPI, tm_of: Callable[[Request], object]) -> None:
    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(request: Request):
        body = await parse_body(request, UpdateFromTensorBody)
        named = deserialize_named_tensors(body.serialized_named_tensors)
        try:
            res = await tm_of(request).update_weights_from_tensor(named, body.flush_cache, body.weight_version)
        except ValueError as e:
            return weight_update_reply(None, str(e))
        return weight_update_reply(res)

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request):
        body = await parse_body(request, UpdateFromDiskBody)
        try:
            res = await tm_of(request).update_weights_from_disk(body.model_path, body.flush_cache,
                                                                body.weight_version)
        except (ValueError, FileNotFoundError) as e:
            if auth_of(request).authenticated:
                return weight_update_reply(None, str(e))
            logger.warning("update_weights_from_disk(%r) failed: %s", body.model_path, e)
            return weight_update_reply(None, "cannot load weights from model_path (the server log has the "
                                             "reason; callers with the admin key are told)")
        return weight_update_reply(res)

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request):
        body = await parse_body(request, InitWeightsUpdateGroupBody)
        try:
            res = await tm_of(request).init_weights_update_group(
                body.master_address, body.master_port, body.rank_offset, body.world_size, body.group_name,
                body.backend)
        except ValueError as e:
            return weight_update_reply(None, str(e))
        return ORJSONResponse(res)

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request):
        body = await parse_body(request, UpdateFromDistributedBody)
        try:
            res = await tm_of(request).update_weights_from_distributed(
                body.names, body.dtypes, body.shapes, body.group_name, body.flush_cache, body.weight_version,
                body.abort_all_requests)
        except ValueError as e:
            return weight_update_reply(None, str(e))
        return weight_update_reply(res)

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request):
        body = await parse_body(request, DestroyWeightsUpdateGroupBody)
        try:
            return ORJSONResponse(await tm_of(request).destroy_weights_update_group(body.group_name))
        except ValueError as e:
            return weight_update_reply(None, str(e))

    @app.api_route("/get_weights_by_name", methods=["GET", "POST"])
    async def get_weights_by_name(request: Request):
        body = await parse_body(request, GetWeightsBody)
        limit = tm_of(request).args.max_weights_response_elements
        return ORJSONResponse(await tm_of(request).get_weights_by_name(body.name, body.truncate_size, limit))

    @app.get("/get_weight_version")
    async def get_weight_version(request: Request):
        return ORJSONResponse({"weight_version": tm_of(request).weight_version})

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request):
        body = await parse_body(request, WeightVersionBody)
        tm_of(request).update_weight_version(body.new_version)
        return ORJSONResponse({"success": True, "weight_version": body.new_version})

    @app.post("/release_memory_occupation")
    async def release_memory_occupation(request: Request):
        try:
            await tm_of(request).release_memory_occupation()
        except RuntimeError as e:
            raise ValueError(str(e).split(": ", 1)[-1]) from None
        return ORJSONResponse({"success": True})

    @app.post("/resume_memory_occupation")
    async def resume_memory_occupation(request: Request):
        await tm_of(request).resume_memory_occupation()
        return ORJSONResponse({"success": True})
