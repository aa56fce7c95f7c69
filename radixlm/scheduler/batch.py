"""The contract between the scheduler and the model runner.

The scheduler describes a step in plain ids and lengths (`WorkerBatch`); the runner turns it
into device tensors, runs the model, samples and returns `BatchResult`. The scheduler never
imports the runner: it is handed one through its constructor.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from radixlm.core import Req
from radixlm.speculative.acceptance import Verified


@dataclass
class WorkerBatch:
    mode: str  # "extend" or "decode"
    reqs: list[Req]
    input_ids: list[int]
    out_cache_loc: torch.Tensor  # int64 [num_tokens]
    prefix_lens: list[int]
    extend_lens: list[int]
    # False for a request whose prefill chunk is not its last one: no token is sampled for it.
    sample: list[bool]
    # For each request, the [start, end) range of its extend-token indices whose next-token
    # logprobs are wanted as input logprobs, and the token ids those positions predict.
    input_logprob_ranges: list[tuple[int, int]] = field(default_factory=list)
    input_logprob_targets: list[list[int]] = field(default_factory=list)
    # Overlap scheduling: id() of the batch whose output the negative input ids name, and
    # copies of the requests' output ids for sampling (the scheduler appends to the live
    # lists while this batch runs), ending with the input's placeholder where it has one.
    placeholder_source: int | None = None
    output_snapshots: list[list[int]] | None = None
    # Structured output: each request's grammar matcher (None: unconstrained), captured when
    # the batch is built. The forward masks the logits with it and accepts the sampled token
    # right away, so the next launched batch always sees an up-to-date matcher.
    grammars: list[Any] | None = None
    # Set by the runner once it has advanced the matchers by this batch's tokens: a batch that
    # fails after that cannot simply be run again for its grammar rows (error_boundary.py).
    grammars_advanced: bool = False
    # Speculative decoding: each row's draft tokens, verified in this step (None: a plain
    # step). A row with drafts d is the extend [last, *d] over its KV (docs/speculative.md).
    drafts: list[list[int]] | None = None
    # Grammar rows' masks at every verified position (int32 [sum(len(d) + 1), ceil(V / 32)]) and
    # the flat positions they cover, filled by the scheduler before the forward (None: no grammar row).
    draft_bitmask: torch.Tensor | None = None
    draft_mask_rows: list[int] = field(default_factory=list)

    @property
    def is_decode(self) -> bool:
        return self.mode == "decode"

    @property
    def has_drafts(self) -> bool:
        return self.drafts is not None and any(self.drafts)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


@dataclass
class BatchResult:
    next_token_ids: list[int | None]
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[float, int]] | None]
    # Per request: logprobs of the prompt tokens following each position in its range.
    input_logprobs: list[list[float] | None]
    input_top_logprobs: list[list[list[tuple[float, int]]] | None]
    # Per request, after its sampled token was accepted by its grammar matcher: None (no
    # grammar, or still open), "terminated" (the grammar is complete) or "rejected".
    grammar_status: list[str | None] | None = None
    # Speculative decoding (batch.drafts set): per request the tokens the step emits (accepted
    # drafts + the target's own), None for a row that computed nothing (a failed replay).
    verified: list[Verified | None] | None = None


class LaunchedForward(Protocol):
    """A batch the runner has launched; its host result may still be on the way."""

    batch: WorkerBatch
    # int64 [len(batch.reqs)] on the runner's device, -1 where nothing was sampled: the next
    # batch's placeholder input ids are resolved from it without the host reading it.
    tokens: torch.Tensor

    def result(self) -> BatchResult:
        """Wait for the host copy of the result (idempotent, callable from any thread)."""
        ...

    def span(self) -> tuple[float, float]:
        """(start, end) of the forward in seconds on the runner's clock; after result()."""
        ...


class ModelRunnerProtocol(Protocol):
    """Everything the scheduler asks of a model runner (radixlm/srt/model_runner/runner.py; the
    tests' fake runner)."""

    vocab_size: int
    max_context_len: int
    eos_token_ids: tuple[int, ...]

    def launch(self, batch: WorkerBatch, prev: LaunchedForward | None = None) -> LaunchedForward:
        """Start the forward; `prev` (the batch launched just before) is given when the
        batch's input ids hold placeholders naming its rows."""
        ...

    def update_weights_from_tensor(self, named_tensors: list[tuple[str, torch.Tensor]]) -> int:
        """Replace weights by Hugging Face name, all or nothing; returns how many."""
        ...

    def update_weights_from_disk(self, model_path: str) -> int:
        ...

    def get_weights_by_name(self, name: str, truncate_size: int = 100, max_elements: int | None = None) -> list[Any]:
        """The first `truncate_size` rows of a weight; refuses an answer over `max_elements`."""
        ...

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str, backend: str) -> dict[str, Any]:
        """Join a trainer's weight-update group (distributed weight sync); {success, message}."""
        ...

    def update_weights_from_distributed(self, names: list[str], dtypes: list[Any], shapes: list[list[int]],
                                        group_name: str) -> int:
        """Receive the named tensors the trainer broadcasts and apply them, all or nothing."""
        ...

    def destroy_weights_update_group(self, group_name: str) -> dict[str, Any]:
        ...

    def release_memory(self) -> None:
        """Give the KV pool's memory back (its contents are lost)."""
        ...

    def resume_memory(self) -> None:
        ...

    def info(self) -> dict[str, Any]:
        """What get_server_info reports about the model and the device."""
        ...
