"""The request as the scheduler sees it: ids, lengths and finish reason.

KV ownership of one request is described by lengths over its row of the
request-to-token table (see docs/architecture.md, "Who owns what"):

    [0, cache_protected_len)          slots owned by the prefix cache, locked through last_node
    [cache_protected_len, kv_committed_len)   slots owned by the request, KV written
    [kv_committed_len, kv_allocated_len)      slots owned by the request, not yet written

Those fields are written by the cache manager (radixlm/scheduler/cache_manager.py) alone;
every stop (finish, abort, retract) hands the request to its one exit, `release`, which returns
the request-owned slots exactly once.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from radixlm.sampling_params import TOP_K_ALL, SamplingParams

__all__ = ["Req", "FinishReason", "SamplingParams", "TOP_K_ALL", "KV_FIELDS"]

# The fields only the cache manager writes (test_layering checks that no other module does).
KV_FIELDS = ("req_pool_idx", "last_node", "cache_protected_len", "kv_committed_len", "kv_allocated_len",
             "prefix_len", "cached_tokens", "kv_poisoned")


@dataclass
class FinishReason:
    type: str  # "stop" | "length" | "abort"
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None
    status_code: int | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"type": self.type}
        if self.type == "stop":
            d["matched"] = self.matched
        elif self.type == "length":
            d["length"] = self.length
        else:
            d["message"] = self.message
            if self.status_code is not None:
                d["status_code"] = self.status_code
        return d

    @staticmethod
    def abort(message: str = "Aborted by the client", status_code: int = 200) -> FinishReason:
        return FinishReason("abort", message=message, status_code=status_code)


@dataclass(eq=False)
class Req:
    rid: str
    origin_input_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    return_logprob: bool = False
    top_logprobs_num: int = 0
    # Token ids whose logprobs each logprob position also reports (SGLang's token_ids_logprob):
    # a position's top list is its top_logprobs_num best entries, then these, in this order.
    token_ids_logprob: tuple[int, ...] = ()
    # Index into the prompt from which input logprobs are returned (-1: none).
    logprob_start_len: int = -1
    extra_key: str | None = None
    priority: int = 0
    stream: bool = False
    timeout: float | None = None  # seconds from arrival (per-request deadline)
    # disaggregation: the room its KV is sent to / comes from (radixlm.disaggregation.protocol.Bootstrap)
    bootstrap: Any = None

    output_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    # Set by abort while the request sits in a launched batch; consumed before other checks.
    to_finish: FinishReason | None = None

    # ---- KV state: written by the cache manager only, cleared by its release ----
    req_pool_idx: int | None = None
    last_node: Any = None  # the prefix cache's node handle this request locks (opaque here)
    cache_protected_len: int = 0
    kv_committed_len: int = 0
    kv_allocated_len: int = 0
    prefix_len: int = 0  # tokens matched in the prefix cache at admission
    # Set when a forward or the processing of this request failed: its KV may be half
    # written, so its release frees the slots instead of publishing them in the prefix cache.
    kv_poisoned: bool = False
    # Overlap scheduling: launched batches holding this request whose results are not yet
    # processed, and tokens sampled by them but not yet appended to output_ids.
    inflight: int = 0
    pending_tokens: int = 0
    # Structured output: the grammar matcher (opaque here; only the forward side advances it).
    # Kept across retraction, since output_ids are; dropped when the request finishes.
    grammar: Any = None
    # Speculative decoding: the request's acceptance tracker and counters (scheduler/speculation.py's
    # SpecState; a plain value, nothing to free on any stop path). None: speculation off.
    spec: Any = None

    # ---- reporting ----
    cached_tokens: int = 0  # the prompt's cache hit (set by the cache manager at admission)
    num_retractions: int = 0
    # prompt logprobs: position 0 (if requested) has none
    input_token_logprobs: list[tuple[float | None, int]] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[float, int]] | None] = field(default_factory=list)
    output_token_logprobs: list[tuple[float, int]] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    created_time: float = field(default_factory=time.perf_counter)
    admit_time: float | None = None  # first admission (running-timeout clock)
    abort_sent_time: float | None = None  # wall time of the abort call, for cancel latency
    # wall time the latest batch holding this request was launched: an abort's KV comes back when
    # the step in progress ends if that batch was launched before the abort (cancel latency)
    last_launch_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    # Token count of output already delivered to the caller (streaming).
    sent_len: int = 0
    detok_sent: bool = False

    # ---------------------------------------------------------------
    @property
    def fill_ids(self) -> list[int]:
        """All tokens whose KV this request needs before it can sample its next token."""
        return self.origin_input_ids + self.output_ids

    @property
    def seqlen(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def keeps_top_lists(self) -> bool:
        """Whether each logprob position keeps a list (top_logprobs_num best, then token_ids_logprob's)."""
        return self.top_logprobs_num > 0 or bool(self.token_ids_logprob)

    def check_finished(self) -> None:
        """Decide finish after a new output token was appended (stop strings are the detokenizer's)."""
        if self.finished:
            return
        if self.to_finish is not None:
            self.finish_reason, self.to_finish = self.to_finish, None
            return
        sp = self.sampling_params
        n_out = len(self.output_ids)
        if n_out == 0:
            return
        last = self.output_ids[-1]
        if n_out >= sp.min_new_tokens:
            if last in sp.stop_token_ids:
                self.finish_reason = FinishReason("stop", matched=last)
                return
            if not sp.ignore_eos and last in self.eos_token_ids:
                self.finish_reason = FinishReason("stop", matched=last)
                return
        if n_out >= sp.max_new_tokens:
            self.finish_reason = FinishReason("length", length=sp.max_new_tokens)
