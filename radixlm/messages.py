"""Wire messages between the tokenizer side and the scheduler (dataclasses, one codec)."""
from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any

from radixlm.sampling_params import SamplingParams


@dataclass
class SessionParams:
    """A turn of a session (SGLang's session_params; semantics §15)."""
    id: str
    rid: str | None = None  # the finished turn to continue from; None: the session's start
    offset: int | None = None  # keep only this many tokens of that turn's prompt + output
    replace: bool = False  # the turns after `rid` (all, without one) leave the history
    drop_previous_output: bool = False  # continue from that turn's prompt only
    # this turn's name in the session (the caller's rid; the scheduler's rid may carry a suffix)
    turn: str | None = None


@dataclass
class TokenizedGenerateReq:
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    stream: bool = False
    extra_key: str | None = None
    # ids whose logprobs every logprob position reports (after its top_logprobs_num best)
    token_ids_logprob: tuple[int, ...] = ()
    priority: int | None = None  # None: the server's default priority (scheduler/priority.py)
    timeout: float | None = None  # seconds from arrival; past it the request ends with 503
    # disaggregation: (bootstrap_host, bootstrap_port, bootstrap_room, index among n > 1 children)
    bootstrap: tuple[str, int, int, int] | None = None
    session: SessionParams | None = None


@dataclass
class AbortReq:
    rid: str = ""
    abort_all: bool = False
    prefix: bool = False
    # Exact scheduler rids (the tokenizer manager resolves names to these).
    rids: list[str] = field(default_factory=list)
    sent_time: float = 0.0  # time.time() at the abort call, for cancel latency


@dataclass
class RejectRoomsReq:
    """Disaggregation: the front end refused a request that came with rooms (bad input): the
    peer server's side of each room is answered with this error at once, not after a timeout."""
    rooms: list[tuple[str, int, int, int]] = field(default_factory=list)  # (host, port, room, child)
    message: str = ""
    status_code: int = 400


@dataclass
class RpcReq:
    """A control request that expects exactly one RpcReply with the same call_id."""
    call_id: int = 0


@dataclass
class FlushCacheReq(RpcReq):
    pass


@dataclass
class OpenSessionReq(RpcReq):
    capacity: int = 0  # tokens of KV the session may hold (SGLang: capacity_of_str_len)
    session_id: str | None = None  # None: one is made up
    timeout: float | None = None  # closed after this long with no turn in flight (s)


@dataclass
class CloseSessionReq(RpcReq):
    session_id: str = ""


@dataclass
class PauseReq(RpcReq):
    mode: str = "abort"  # "abort" | "retract" | "in_place"


@dataclass
class ContinueReq(RpcReq):
    pass


@dataclass
class GetInfoReq(RpcReq):
    pass


@dataclass
class CheckIntegrityReq(RpcReq):
    pass


@dataclass
class UpdateWeightsFromTensorReq(RpcReq):
    named_tensors: list = field(default_factory=list)  # [(hf_name, tensor)]
    flush_cache: bool = True
    # extra_key of requests computed from now on: requests with no KV yet move to it
    cache_namespace: str | None = None


@dataclass
class UpdateWeightsFromDiskReq(RpcReq):
    model_path: str = ""
    flush_cache: bool = True
    cache_namespace: str | None = None  # as in UpdateWeightsFromTensorReq


@dataclass
class InitWeightsUpdateGroupReq(RpcReq):
    """Join a trainer's torch.distributed group: this rank is rank_offset + its TP rank."""
    master_address: str = ""
    master_port: int = 0
    rank_offset: int = 1
    world_size: int = 2
    group_name: str = "weight_update_group"
    backend: str = "nccl"


@dataclass
class UpdateWeightsFromDistributedReq(RpcReq):
    """Receive each named tensor from the group's rank 0 (the trainer) by broadcast."""
    names: list[str] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    cache_namespace: str | None = None  # as in UpdateWeightsFromTensorReq

@dataclass
class DestroyWeightsUpdateGroupReq(RpcReq):
    group_name: str = "weight_update_group"


@dataclass
class GetWeightsByNameReq(RpcReq):
    name: str = ""
    truncate_size: int = 100
    max_elements: int | None = None  # refuse a larger answer (HTTP: --max-weights-response-elements)


@dataclass
class ReleaseMemoryReq(RpcReq):
    pass


@dataclass
class ResumeMemoryReq(RpcReq):
    pass


@dataclass
class RpcReply:
    call_id: int
    result: Any = None
    error: str | None = None


@dataclass
class ShutdownReq:
    pass


@dataclass
class ReqOutput:
    """New output of one request since the last message about it."""
    rid: str
    new_token_ids: list[int]
    finish_reason: dict[str, Any] | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    num_retractions: int = 0
    output_token_logprobs: list[tuple[float, int]] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    input_token_logprobs: list[tuple[float | None, int]] | None = None
    input_top_logprobs: list[list[tuple[float, int]] | None] | None = None
    # What the detokenizer needs; set on the request's first output only.
    detok: "DetokParams | None" = None
    # Speculative decoding (None: off): verify steps so far, draft tokens verified, accepted.
    spec_verify_ct: int | None = None
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0


@dataclass
class DetokParams:
    stop: tuple[str, ...] = ()
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    stop_regex: tuple[str, ...] = ()
    # A non-streamed request: its ids still arrive every step (an abort is answered with all of
    # them), but its text is decoded once, when it finishes; the front end decodes the ids it
    # holds itself if it answers the request first (docs/cancel_chain.md).
    text_at_end: bool = False


@dataclass
class BatchTokenOut:
    outputs: list[ReqOutput]


@dataclass
class ReqTextOutput:
    """ReqOutput after detokenization: `new_text` is the newly released text."""
    out: ReqOutput
    new_text: str
    # The detokenizer could not handle this request and ended it (out.finish_reason is its
    # 500 abort); the scheduler still runs it until the tokenizer manager's abort arrives.
    failed: bool = False


@dataclass
class BatchTextOut:
    outputs: list[ReqTextOutput]


def encode(msg: Any) -> bytes:
    return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes) -> Any:
    return pickle.loads(data)
