"""The forward the integration will verify drafts with: on the cpu attention backend, an
EXTEND of K tokens after a cached prefix gives bit for bit the logits of K sequential DECODE
steps (batch of one and with other rows alongside), in float32 and bfloat16. That is what makes
speculative greedy output token-identical to plain decoding (and seeded sampling too: the
sampler draws from the same logits with the same uniform per output index).

The torch_native backend does not have this property (its extend and decode paths reduce in a
different order: ~1e-5 apart), which is one reason the README has speculation start on cpu only.
"""
from __future__ import annotations

import pytest
import torch

from radixlm.config import ServerArgs
from radixlm.kernels.cpu import ops as cpu_ops
from radixlm.srt.model_runner.forward_batch import ForwardBatch, ForwardMode
from radixlm.srt.model_runner.runner import ModelRunner

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="the native CPU kernels did not build")
K = 6
_next_slot = [1]  # KV slots handed out by this test (slot 0 is the padding slot); never freed


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def runner(request: pytest.FixtureRequest, tiny_llama_dir: str) -> ModelRunner:
    args = ServerArgs.from_kwargs(model_path=tiny_llama_dir, dtype=request.param, max_total_tokens=1024,
                                  attention_backend="cpu")
    _next_slot[0] = 1  # a fresh KV pool
    # The scheduler redesign (branch i19) hands the runner a RunnerConfig; main a ServerArgs.
    return ModelRunner(args.runner_config() if hasattr(args, "runner_config") else args)


def _table(r: ModelRunner) -> torch.Tensor:
    # i19: the runner owns the bare table; main: inside its ReqToTokenPool.
    return r.req_to_token if hasattr(r, "req_to_token") else r.req_to_token_pool.req_to_token


@torch.inference_mode()
def forward(r: ModelRunner, mode: ForwardMode, rows: list[tuple[list[int], int, int]]) -> torch.Tensor:
    """Logits of every position of rows (input ids, request slot, prefix length); each row's
    new tokens get fresh KV slots, written into the request-to-token table here (the runner is
    the test's alone: no cache manager)."""
    table = _table(r)
    ids, locs, slots, prefixes, lens = [], [], [], [], []
    for toks, slot, prefix in rows:
        loc = torch.arange(_next_slot[0], _next_slot[0] + len(toks), dtype=torch.int64)
        _next_slot[0] += len(toks)
        assert _next_slot[0] <= 1024, "the test ran out of KV slots"
        table[slot, prefix:prefix + len(toks)] = loc
        ids += toks
        locs.append(loc)
        slots.append(slot)
        prefixes.append(prefix)
        lens.append(len(toks))
    fb = ForwardBatch.build(mode, ids, torch.cat(locs), slots, prefixes, lens, table, "cpu")
    r.attn.init_forward_metadata(fb)
    return r.model.compute_logits(r.model.forward(fb, r.attn)).float()


@pytest.mark.parametrize("others", [0, 3])
def test_extend_logits_equal_sequential_decode_logits(runner: ModelRunner, others: int):
    r = runner
    prompt = [(37 * j) % 200 + 5 for j in range(40)]
    side = list(range(2, 2 + others))  # other requests decoding in the same batches
    for slot in [0, 1, *side]:
        forward(r, ForwardMode.EXTEND, [(prompt, slot, 0)])
    token = int(forward(r, ForwardMode.EXTEND, [(prompt, 0, 0)])[-1].argmax())
    tokens, decoded = [], []
    for j in range(K):
        tokens.append(token)
        rows = [([token], 0, len(prompt) + j)] + [([7 + s], s, len(prompt) + j) for s in side]
        logits = forward(r, ForwardMode.DECODE, rows)[0]
        decoded.append(logits)
        token = int(logits.argmax())
    # Slot 1 holds the same prompt KV; verify all K tokens in one extend, with the side rows
    # as one-token extends (a speculative batch mixes drafted and undrafted rows).
    rows = [(tokens, 1, len(prompt))] + [([7 + s], s, len(prompt) + K) for s in side]
    verified = forward(r, ForwardMode.EXTEND, rows)[:K]
    assert torch.equal(verified, torch.stack(decoded))
