"""Cost-bounded chunks (prefill.py): while requests decode, a long prompt's chunks over a
growing prefix get shorter so that each costs what a chunk with no prefix does; alone, or with
the bound turned off, a prompt runs in full chunks. Outputs are the same either way."""
from __future__ import annotations

import random

import pytest

from radixlm.config import ModelConfig
from radixlm.scheduler.prefill import MIN_COST_BOUNDED_CHUNK
from test.support.fake_runner import reference_output
from test.support.scheduler_harness import make_harness

CHUNK, KEYS = 256, 768  # a new token's linears cost its attention to 768 keys (3 chunks, as on SmolLM2)


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(97) for _ in range(n)]


def _chunks(h, rid: str) -> list[tuple[int, int]]:
    """(prefix, extend) of every forward that carried a part of rid's prompt."""
    out = []
    for batch in h.runner.forward_calls:
        for req, prefix, ext in zip(batch.reqs, batch.prefix_lens, batch.extend_lens):
            if req.rid == rid and prefix < len(req.origin_input_ids):
                out.append((prefix, ext))
    return out


def _run_long_prompt_beside_a_decode(**harness_args):
    h = make_harness(capacity=4096, chunk=CHUNK, context=2048, **harness_args)
    decoder = h.submit(_prompt(10, 1), max_new_tokens=200, ignore_eos=True)
    for _ in range(3):
        h.scheduler.step()  # the short request is decoding
    long_prompt = _prompt(1500, 2)
    rid = h.submit(long_prompt, max_new_tokens=4)
    h.run()
    assert h.tokens(rid) == reference_output(long_prompt, 4)
    assert h.tokens(decoder) == reference_output(_prompt(10, 1), 200)
    h.assert_idle_and_conserved()
    return _chunks(h, rid)


def test_chunks_over_a_growing_prefix_shrink_to_the_cost_of_a_prefix_free_chunk():
    chunks = _run_long_prompt_beside_a_decode(chunk_cost_keys=KEYS)
    assert sum(e for _, e in chunks) == 1500 and chunks[0] == (0, CHUNK)
    budget = CHUNK * (KEYS + CHUNK / 2)
    for prefix, ext in chunks[:-1]:  # the last is the prompt's tail, whatever is left
        assert ext * (KEYS + prefix + ext / 2) <= budget or ext == MIN_COST_BOUNDED_CHUNK
    lengths = [e for _, e in chunks[:-1]]
    assert lengths == sorted(lengths, reverse=True) and lengths[-1] < CHUNK // 2
    # The last full-cost chunk is within a token of the budget (the bound is not loose).
    prefix, ext = chunks[-2]
    assert (ext + 1) * (KEYS + prefix + (ext + 1) / 2) > budget


@pytest.mark.parametrize("bound", [None, "disabled"])
def test_without_the_bound_every_chunk_is_full(bound):
    args = {"chunk_cost_keys": KEYS, "disable_chunk_cost_bound": True} if bound else {}
    chunks = _run_long_prompt_beside_a_decode(**args)
    assert [e for _, e in chunks] == [CHUNK] * 5 + [1500 - 5 * CHUNK]


def test_a_prompt_alone_runs_in_full_chunks():
    h = make_harness(capacity=4096, chunk=CHUNK, context=2048, chunk_cost_keys=KEYS)
    long_prompt = _prompt(1500, 3)
    rid = h.submit(long_prompt, max_new_tokens=2)
    h.run()
    assert [e for _, e in _chunks(h, rid)] == [CHUNK] * 5 + [1500 - 5 * CHUNK]
    assert h.tokens(rid) == reference_output(long_prompt, 2)


def test_a_second_prompt_waits_rather_than_take_a_sliver():
    """Two long prompts arrive while a request decodes: the first takes the whole cost budget
    of a step; the second is not admitted for a few tokens (it waits for its own turn)."""
    h = make_harness(capacity=8192, chunk=CHUNK, context=2048, chunk_cost_keys=KEYS)
    h.submit(_prompt(10, 1), max_new_tokens=100, ignore_eos=True)
    for _ in range(3):
        h.scheduler.step()
    a, b = h.submit(_prompt(1000, 4), max_new_tokens=1), h.submit(_prompt(1000, 5), max_new_tokens=1)
    h.run()
    for batch in h.runner.forward_calls:
        # every chunk but a prompt's tail (and the decode rows of one token)
        cut = [e for r, p, e in zip(batch.reqs, batch.prefix_lens, batch.extend_lens)
               if r.rid in (a, b) and p + e < len(r.origin_input_ids)]
        assert all(e >= MIN_COST_BOUNDED_CHUNK for e in cut), cut
    h.assert_idle_and_conserved()


def test_chunk_cost_keys_of_the_default_model():
    smollm2 = ModelConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                          num_key_value_heads=3, head_dim=64)
    # (576 x 15 x 64 + 9 x 64 x 576 + 3 x 576 x 1536) / (2 x 9 x 64)
    assert smollm2.chunk_cost_keys == 3072
