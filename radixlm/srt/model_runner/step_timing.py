"""Start-up timing of forwards at a few token counts, for speculation's cost model
(speculative/step_cost.py): one synthetic row over a short context, extending T tokens with
logits at every position, as a verify step computes them.

It runs before the scheduler takes any request, on request slot 0 and KV slots 1.. (all free
then); the KV it writes is never read by a request, whose own forward writes every slot before
attention reads it. Row 0 of req_to_token is zeroed again afterwards.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from radixlm.speculative.step_cost import StepCost
from radixlm.srt.model_runner.forward_batch import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from radixlm.srt.model_runner.runner import ModelRunner

__all__ = ["measure_step_cost", "step_cost_points"]

logger = logging.getLogger(__name__)

CONTEXT_LEN = 128  # keys before the timed tokens (short: the linears are what differ)
LARGE_POINTS = (16, 32, 64)  # beyond these, the last segment's slope (compute-bound: linear)


def step_cost_points(max_draft_tokens: int) -> tuple[int, ...]:
    """Every count a single stream's verify step can have (1 .. 1 + max drafts), then a few
    larger ones for batches."""
    small = range(1, max_draft_tokens + 2)
    return tuple(sorted(set(small) | {p for p in LARGE_POINTS if p > max_draft_tokens + 1}))


@torch.inference_mode()
def measure_step_cost(runner: ModelRunner, max_draft_tokens: int, repeats: int = 3) -> StepCost | None:
    """Forward + LM head seconds at each of step_cost_points (the minimum of `repeats`, rounds
    interleaved so that a slow moment spreads over all points), or None where the pool is too
    small to time them."""
    points = step_cost_points(max_draft_tokens)
    ctx = min(CONTEXT_LEN, runner.max_context_len - points[-1] - 1)
    if ctx < 1 or ctx + points[-1] + 1 > runner.sizes.max_total_tokens:
        return None
    table = runner.req_to_token
    table[0, :ctx + points[-1]] = torch.arange(1, ctx + points[-1] + 1)

    def forward(prefix: int, n: int) -> float:
        mode = ForwardMode.DECODE if n == 1 else ForwardMode.EXTEND
        ids = [(7 * j + 13) % runner.vocab_size for j in range(n)]
        fb = ForwardBatch.build(mode, ids, table[0, prefix:prefix + n], [0], [prefix], [n], table, runner.device)
        t0 = time.perf_counter()
        runner.attn.init_forward_metadata(fb)
        runner.model.compute_logits(runner.model.forward(fb, runner.attn))  # CPU: returns when done
        return time.perf_counter() - t0

    try:
        forward(0, ctx)  # the context's KV (and a warm-up)
        for n in points:
            forward(ctx, n)
        best = [float("inf")] * len(points)
        for _ in range(repeats):
            for i, n in enumerate(points):
                best[i] = min(best[i], forward(ctx, n))
    finally:
        table[0].zero_()
    cost = StepCost(points, tuple(best))
    logger.info("speculation: forward ms at %s tokens: %s", list(points), cost.as_dict()["ms"])
    return cost
