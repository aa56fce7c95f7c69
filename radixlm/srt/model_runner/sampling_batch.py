"""What the sampler is given per request, what it returns, and how a batch is classified.

The model runner builds one `SamplingRow` per request of the batch; the sampler returns
one `SampleOutput` for the whole batch. `BatchPlan` sorts the rows once per call into the
groups that need different work (plain greedy, penalties, filtering, logprobs), so the
sampler never touches a row with an operation it does not need.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable

from radixlm.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

__all__ = ["SamplingRow", "SampleOutput", "SampleTensors", "BatchPlan", "VocabMask", "build_stop_ids"]


def build_stop_ids(params: SamplingParams, eos_token_ids: Iterable[int]) -> frozenset[int]:
    """The tokens that would stop this request, i.e. the ones min_new_tokens must mask.

    With ignore_eos the EOS ids do not stop the request, so they need no masking either;
    only the explicit stop_token_ids remain.
    """
    ids = set(params.stop_token_ids)
    if not params.ignore_eos:
        ids.update(eos_token_ids)
    return frozenset(ids)


@dataclass
class SamplingRow:
    """One request of the batch, as the sampler needs it."""

    params: SamplingParams
    prompt_ids: list[int]
    # Tokens generated so far; the token sampled now becomes output index len(output_ids).
    # Under overlap scheduling the newest entry may still be a placeholder (negative; see
    # scheduler/overlap.py) for rows without penalties: only penalties read the values.
    output_ids: list[int]
    # Tokens masked to -inf while len(output_ids) < params.min_new_tokens (see build_stop_ids).
    stop_ids: frozenset[int] = frozenset()
    return_logprob: bool = False
    # Only honoured together with return_logprob.
    top_logprobs_num: int = 0
    # Ids whose logprobs follow the top entries in this row's top list (token_ids_logprob).
    token_ids_logprob: tuple[int, ...] = ()

    @property
    def needs_penalty(self) -> bool:
        return self.params.has_penalty

    @property
    def needs_bias(self) -> bool:
        return bool(self.params.logit_bias)

    @property
    def min_new_active(self) -> bool:
        return bool(self.stop_ids) and len(self.output_ids) < self.params.min_new_tokens


@dataclass
class VocabMask:
    """Tokens a grammar allows for some rows of the batch (structured output).

    Bit t % 32 of int32 word t // 32 of `bitmask[i]` is 1 when token t is allowed for row i;
    rows not listed in `rows` are not masked (their bitmask rows are ignored)."""

    bitmask: "torch.Tensor"  # int32 [B, ceil(V / 32)], on the logits' device
    rows: list[int]


@dataclass
class SampleOutput:
    next_token_ids: list[int]
    # Raw-model logprob of the chosen token (log_softmax of the unprocessed logits);
    # None where return_logprob was not set.
    logprobs: list[float | None]
    # Top `top_logprobs_num` (logprob, token id) by raw logprob, best first;
    # None where not requested.
    top_logprobs: list[list[tuple[float, int]] | None]


@dataclass
class SampleTensors:
    """A sample() result before the host has read any of it (so it can stay on the device
    until a copy-done event says the host copies are there).

    `logprobs[j]` and the top lists of row j belong to request row `logprob_rows[j]`."""

    ids: "torch.Tensor"  # int64 [B]
    logprob_rows: list[int] = field(default_factory=list)
    logprobs: "torch.Tensor | None" = None  # float32 [len(logprob_rows)]
    top_values: "torch.Tensor | None" = None  # float32 [len(logprob_rows), max top_logprobs_num]
    top_ids: "torch.Tensor | None" = None  # int64, same shape
    top_nums: list[int] = field(default_factory=list)  # top_logprobs_num of each logprob row
    # token_ids_logprob: each logprob row's requested ids (padded with 0 to the longest) and
    # their logprobs, read after the row's top entries
    asked_ids: "torch.Tensor | None" = None  # int64 [len(logprob_rows), longest list]
    asked_values: "torch.Tensor | None" = None  # float32, same shape
    asked_nums: list[int] = field(default_factory=list)

    def map(self, fn: Callable[["torch.Tensor"], "torch.Tensor"]) -> "SampleTensors":
        """The same result with every tensor replaced by fn(tensor) (e.g. a host copy)."""
        def opt(t):
            return None if t is None else fn(t)
        return SampleTensors(fn(self.ids), self.logprob_rows, opt(self.logprobs), opt(self.top_values),
                             opt(self.top_ids), self.top_nums, opt(self.asked_ids), opt(self.asked_values),
                             self.asked_nums)

    def to_output(self) -> SampleOutput:
        b = int(self.ids.numel())
        logprobs: list[float | None] = [None] * b
        tops: list[list[tuple[float, int]] | None] = [None] * b
        if self.logprobs is not None:
            for i, lp in zip(self.logprob_rows, self.logprobs.tolist()):
                logprobs[i] = lp
        if self.top_values is not None:
            for i, k, v, t in zip(self.logprob_rows, self.top_nums, self.top_values.tolist(),
                                  self.top_ids.tolist()):
                if k > 0:
                    tops[i] = list(zip(v[:k], t[:k]))
        if self.asked_values is not None:
            for i, m, v, t in zip(self.logprob_rows, self.asked_nums, self.asked_values.tolist(),
                                  self.asked_ids.tolist()):
                if m > 0:
                    tops[i] = (tops[i] or []) + list(zip(v[:m], t[:m]))
        return SampleOutput(self.ids.tolist(), logprobs, tops)


@dataclass
class BatchPlan:
    """Row indices of the batch grouped by the work they need (built once per call)."""

    greedy: list[int] = field(default_factory=list)
    random: list[int] = field(default_factory=list)
    penalty: list[int] = field(default_factory=list)  # repetition / frequency / presence
    bias: list[int] = field(default_factory=list)  # logit_bias
    min_new: list[int] = field(default_factory=list)  # stop ids masked this step
    logprob: list[int] = field(default_factory=list)
    grammar: list[int] = field(default_factory=list)  # masked by a VocabMask

    @staticmethod
    def build(rows: list[SamplingRow], vocab_mask: VocabMask | None = None) -> "BatchPlan":
        plan = BatchPlan()
        if vocab_mask is not None:
            plan.grammar = list(vocab_mask.rows)
        for i, r in enumerate(rows):
            (plan.greedy if r.params.is_greedy else plan.random).append(i)
            if r.needs_penalty:
                plan.penalty.append(i)
            if r.needs_bias:
                plan.bias.append(i)
            if r.min_new_active:
                plan.min_new.append(i)
            if r.return_logprob:
                plan.logprob.append(i)
        return plan

    @property
    def modifies_logits(self) -> bool:
        return bool(self.penalty or self.bias or self.min_new or self.grammar)

    @property
    def fast_path(self) -> bool:
        """All rows greedy and nothing alters the logits: one argmax decides the batch."""
        return not self.random and not self.modifies_logits
