"""Every message the scheduler receives, mapped to its handler (`HANDLERS`), and the control
RPCs that reach past the scheduling itself: weight updates, memory release, server info.

Messages are applied at the top of an iteration, never in the middle of one. An RPC that needs
the model or the whole KV pool still first lets the launched batch resolve (`sync`).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from radixlm.messages import (
    AbortReq,
    CheckIntegrityReq,
    CloseSessionReq,
    ContinueReq,
    DestroyWeightsUpdateGroupReq,
    FlushCacheReq,
    GetInfoReq,
    GetWeightsByNameReq,
    InitWeightsUpdateGroupReq,
    OpenSessionReq,
    PauseReq,
    RejectRoomsReq,
    ReleaseMemoryReq,
    ResumeMemoryReq,
    TokenizedGenerateReq,
    UpdateWeightsFromDiskReq,
    UpdateWeightsFromDistributedReq,
    UpdateWeightsFromTensorReq,
)
from radixlm.scheduler.port import ControlOps
from radixlm.scheduler.requests import Place

__all__ = ["HANDLERS", "dispatch", "server_info"]

M = TypeVar("M")
Handler = Callable[[ControlOps, Any], object]
HANDLERS: dict[type, Handler] = {}


def _handles(kind: type[M]) -> Callable[[Callable[[ControlOps, M], object]], Callable[[ControlOps, M], object]]:
    def deco(fn: Callable[[ControlOps, M], object]) -> Callable[[ControlOps, M], object]:
        HANDLERS[kind] = fn
        return fn
    return deco


def dispatch(s: ControlOps, msg: object) -> object:
    handler = HANDLERS.get(type(msg))
    if handler is None:
        raise TypeError(f"unknown message {type(msg).__name__}")
    return handler(s, msg)


@_handles(TokenizedGenerateReq)
def _generate(s: ControlOps, msg: TokenizedGenerateReq) -> None:
    try:
        s.add_request(msg)
    except Exception as e:  # noqa: BLE001 - answered, not dropped
        s.reject(msg, e)


@_handles(AbortReq)
def _abort(s: ControlOps, msg: AbortReq) -> int:
    return s.abort(msg)


@_handles(RejectRoomsReq)
def _reject_rooms(s: ControlOps, msg: RejectRoomsReq) -> None:
    if s.transfer is not None:
        s.transfer.reject(msg.rooms, msg.message, msg.status_code)


@_handles(OpenSessionReq)
def _open_session(s: ControlOps, msg: OpenSessionReq) -> dict[str, Any]:
    try:
        return {"success": True, "session_id": s.open_session(msg.capacity, msg.timeout, msg.session_id)}
    except ValueError as e:
        return {"success": False, "message": str(e)}


@_handles(CloseSessionReq)
def _close_session(s: ControlOps, msg: CloseSessionReq) -> dict[str, Any]:
    try:
        s.close_session(msg.session_id)
        return {"success": True}
    except ValueError as e:
        return {"success": False, "message": str(e)}


@_handles(FlushCacheReq)
def _flush(s: ControlOps, msg: FlushCacheReq) -> bool:
    return s.flush_cache()


@_handles(GetInfoReq)
def _info(s: ControlOps, msg: GetInfoReq) -> dict[str, Any]:
    return server_info(s)


@_handles(CheckIntegrityReq)
def _check(s: ControlOps, msg: CheckIntegrityReq) -> bool:
    s.check_integrity()
    return True


@_handles(PauseReq)
def _pause(s: ControlOps, msg: PauseReq) -> bool:
    return s.pause(msg.mode)


@_handles(ContinueReq)
def _continue(s: ControlOps, msg: ContinueReq) -> bool:
    return s.resume()


def _weights_op(s: ControlOps, op: Callable[[], int], flush: bool, namespace: str | None) -> dict[str, Any]:
    """Weights change only between forwards: the launched batch resolves first. The cache is
    namespaced by weight version, so old KV is never served afterwards."""
    s.sync()
    n = op()
    s.forget_drafts()  # drafts learnt from the old weights' text
    live = _move_to_new_weights(s, namespace) if namespace is not None else {}
    return {"num_tensors": n, "flushed": s.flush_cache() if flush else False, "live_output_lens": live}


def _move_to_new_weights(s: ControlOps, namespace: str) -> dict[str, int]:
    """Requests are here during an update only if the engine is paused (the front end's lock
    waits for all others). One with no KV of its own (waiting, retracted, grammar) computes
    everything under the new weights, so it moves to the new cache namespace; a chunked
    prefill is retracted first (its chunks are old-weights KV, and it has no token yet); a
    running (in_place) request keeps its KV and continues on it. Returns each live request's
    output length at the switch (meta_info["weight_versions"])."""
    chunked = s.chunked_req
    if chunked is not None:
        s.retract(chunked)
    for req in s.requests.reqs(Place.WAITING, Place.GRAMMAR):
        # the caller's own namespace (extra_key / cache_salt) follows the weights' one
        caller = (req.extra_key or "").partition("|")[2]
        req.extra_key = f"{namespace}|{caller}" if caller else namespace
    return {r.rid: len(r.output_ids) for r in s.requests.reqs(Place.RUNNING, Place.WAITING, Place.GRAMMAR)}


@_handles(UpdateWeightsFromTensorReq)
def _update_from_tensor(s: ControlOps, msg: UpdateWeightsFromTensorReq) -> dict[str, Any]:
    return _weights_op(s, lambda: s.runner.update_weights_from_tensor(msg.named_tensors), msg.flush_cache,
                       msg.cache_namespace)


@_handles(UpdateWeightsFromDiskReq)
def _update_from_disk(s: ControlOps, msg: UpdateWeightsFromDiskReq) -> dict[str, Any]:
    return _weights_op(s, lambda: s.runner.update_weights_from_disk(msg.model_path), msg.flush_cache,
                       msg.cache_namespace)


@_handles(UpdateWeightsFromDistributedReq)
def _update_from_distributed(s: ControlOps, msg: UpdateWeightsFromDistributedReq) -> dict[str, Any]:
    return _weights_op(s, lambda: s.runner.update_weights_from_distributed(msg.names, msg.dtypes, msg.shapes,
                                                                          msg.group_name), msg.flush_cache,
                       msg.cache_namespace)


@_handles(InitWeightsUpdateGroupReq)
def _init_weights_group(s: ControlOps, msg: InitWeightsUpdateGroupReq) -> dict[str, Any]:
    return s.runner.init_weights_update_group(msg.master_address, msg.master_port, msg.rank_offset,
                                              msg.world_size, msg.group_name, msg.backend)


@_handles(DestroyWeightsUpdateGroupReq)
def _destroy_weights_group(s: ControlOps, msg: DestroyWeightsUpdateGroupReq) -> dict[str, Any]:
    return s.runner.destroy_weights_update_group(msg.group_name)


@_handles(GetWeightsByNameReq)
def _get_weights(s: ControlOps, msg: GetWeightsByNameReq) -> list[Any]:
    s.sync()
    return s.runner.get_weights_by_name(msg.name, msg.truncate_size, msg.max_elements)


def _memory_op(s: ControlOps, release: bool) -> bool:
    s.sync()
    if release:
        if not s.is_idle():
            raise RuntimeError("cannot release memory while requests are running; pause or abort them first")
        s.forget_drafts()  # session-held KV too
        s.cache.flush()  # the KV pool's contents are about to vanish
        s.runner.release_memory()
    else:
        s.runner.resume_memory()
    return True


@_handles(ReleaseMemoryReq)
def _release_memory(s: ControlOps, msg: ReleaseMemoryReq) -> bool:
    return _memory_op(s, release=True)


@_handles(ResumeMemoryReq)
def _resume_memory(s: ControlOps, msg: ResumeMemoryReq) -> bool:
    return _memory_op(s, release=False)


def server_info(s: ControlOps) -> dict[str, Any]:
    tier = s.cache.tier_stats()
    return {"cancel_latency_s": s.cancel_latency.percentiles(), "cancel_latency_hist": s.cancel_latency.histogram(),
            "recent_cancels": s.cancel_latency.recent_cancels(),
            "paused": s.paused, "overlap": s.overlap, "forward_idle_fraction": round(s.timer.idle_fraction(), 4),
            # cumulative, so that a benchmark can difference them over its own window
            "forward_busy_s": round(s.timer.busy_s, 4), "forward_idle_s": round(s.timer.idle_s, 4),
            "memory": s.cache.memory_stats(), "num_running_reqs": s.requests.count(Place.RUNNING),
            "num_waiting_reqs": s.requests.count(Place.WAITING, Place.CHUNKED),
            # prefill work still queued, in tokens (the load a fleet gateway balances on)
            "num_waiting_tokens": sum(r.seqlen for r in s.requests.reqs(Place.WAITING))
            + sum(r.seqlen - r.kv_committed_len for r in s.requests.reqs(Place.CHUNKED)),
            "num_grammar_queue_reqs": len(s.grammar_queue), **s.grammar_queue.stats,
            "new_token_ratio": s.ratio.value, "evicted_tokens_total": s.cache.evicted_tokens_total,
            **s.stats.as_dict(), **s.runner.info(), **({"hicache": tier} if tier is not None else {}),
            "num_transfer_reqs": s.requests.count(Place.TRANSFER),
            **s.sessions.info(), **{k: v for hook in s.hooks for k, v in hook.info().items()}}
