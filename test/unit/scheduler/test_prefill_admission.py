"""Admission measures the room a request has with its own matched prefix locked (semantics §8):
cached tokens it is about to lock are not free space for it."""
from __future__ import annotations

import random

from test.support.fake_runner import reference_output
from test.support.scheduler_harness import make_harness


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(97) for _ in range(n)]


def test_a_cached_prefix_is_not_room_for_the_request_that_locks_it():
    """Regression: the evictable prefix a request matched was counted as room for it. Here it
    was admitted, its later chunks found no room (the prefix it locked had been the room),
    it sat holding KV as chunked prefill while decode ran the pool dry, and the running
    request, which fits the pool, was aborted "out of memory" (500)."""
    h = make_harness(capacity=200, max_running=4, chunk=8)
    cached = _prompt(60, 1)
    h.submit(cached, max_new_tokens=1)
    h.run()  # the 60-token prompt is now evictable cache
    runner = h.submit(_prompt(20, 2), max_new_tokens=120, ignore_eos=True)  # reserves all 120
    for _ in range(4):
        h.scheduler.step()
    late_prompt = cached + _prompt(50, 3)
    late = h.submit(late_prompt, max_new_tokens=5)
    h.run()
    assert h.final(runner).finish_reason == {"type": "length", "length": 120}
    assert h.tokens(late) == reference_output(late_prompt, 5)
    assert h.final(late).finish_reason["type"] == "length"
    h.assert_idle_and_conserved()
