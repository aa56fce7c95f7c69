"""HiCache under the real Scheduler (overlap and normal loops) with the fake model: identical
outputs with and without the host tier on workloads several times the device pool, every write
policy, the stop path (abort during a write, retraction, load-back racing an abort), host-pool
exhaustion, and the metrics. Integrity of both pools and of the fake KV after every step."""
from __future__ import annotations

import random
import time

import pytest

from radixlm.messages import AbortReq

from test.support.fake_runner import reference_output
from test.support.hicache_harness import make_hi_harness, multiturn

POLICIES = ["write_through", "write_through_selective", "write_back"]


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(97) for _ in range(n)]


def _slow(kind_to_delay: dict[str, float]):
    def hook(kind: str) -> None:
        time.sleep(kind_to_delay.get(kind, 0.0))
    return hook


@pytest.mark.parametrize("policy", POLICIES)
def test_multiturn_outputs_identical_with_and_without_hicache(schedule_mode, policy):
    # 6 conversations x 4 turns of 30 user tokens + 8 answer tokens: ~900 tokens of context
    # against a 256-token device pool, so nodes are evicted, backed up and loaded back.
    h = make_hi_harness(capacity=256, write_policy=policy)
    ref = make_hi_harness(capacity=256, hicache=False)
    outs = multiturn(h, num_convs=6, turns=4, user_len=30, max_new=8)
    assert outs == multiturn(ref, num_convs=6, turns=4, user_len=30, max_new=8)
    s = h.stats()
    assert s["loaded_back_tokens_total"] > 0 and s["backed_up_tokens_total"] > 0
    assert s["host_hit_rate"] > 0
    assert h.runner.tokens_computed < ref.runner.tokens_computed  # reloaded, not recomputed
    h.assert_idle_and_conserved()


def test_multiturn_with_chunked_prefill_and_pages(schedule_mode):
    h = make_hi_harness(capacity=256, chunk=16, page_size=4)
    ref = make_hi_harness(capacity=256, chunk=16, page_size=4, hicache=False)
    assert multiturn(h, 5, 4, 26, 6, seed=3) == multiturn(ref, 5, 4, 26, 6, seed=3)
    assert h.stats()["loaded_back_tokens_total"] > 0
    h.assert_idle_and_conserved()


def test_host_pool_exhaustion(schedule_mode):
    # A host pool smaller than the device pool: host eviction must keep making room
    # (dropping host-only nodes, then mirrors of device-resident ones) and never break.
    h = make_hi_harness(capacity=256, hicache_ratio=0.6)
    ref = make_hi_harness(capacity=256, hicache=False)
    assert multiturn(h, 6, 4, 30, 8, seed=5) == multiturn(ref, 6, 4, 30, 8, seed=5)
    s = h.stats()
    assert s["host_used_tokens"] <= s["host_capacity_tokens"] == 153
    assert s["host_evicted_tokens_total"] > 0 and s["mirror_dropped_tokens_total"] > 0
    h.assert_idle_and_conserved()


def test_retraction_under_hicache(schedule_mode):
    # Decode runs out of KV: victims' KV goes to the tree, is written through and evicted
    # to the host; on resume it is loaded back. The client sees one continuous stream.
    h = make_hi_harness(capacity=200, max_running=8)
    prompts = [_prompt(12, i) for i in range(5)]
    rids = [h.submit(p, max_new_tokens=60) for p in prompts]
    h.run()
    assert h.scheduler.stats.num_retractions > 0
    for p, rid in zip(prompts, rids):
        assert h.tokens(rid) == reference_output(p, 60)
        assert h.final(rid).finish_reason["type"] == "length"
    assert h.stats()["loaded_back_tokens_total"] > 0
    h.assert_idle_and_conserved()


def test_abort_during_a_write_keeps_the_node_and_its_kv_reaches_the_host(schedule_mode):
    # Writes take 200 ms: the request is aborted while its KV is being copied to the host.
    h = make_hi_harness(capacity=128, copy_hook=_slow({"write": 0.2}))
    prompt = _prompt(40, 1)
    rid = h.submit(prompt, max_new_tokens=50)
    for _ in range(12):
        h.step()
    tree = h.tree
    assert tree.tier.ongoing_writes, "the prompt's write-through should be in flight"
    h.scheduler.abort(AbortReq(rid=rid))
    h.check()
    while not any(o.finish_reason for o in h.outputs.get(rid, [])):
        h.step()  # (overlap: the abort lands when the launched step is processed)
    assert tree.tier.ongoing_writes
    done = len(h.tokens(rid))
    assert h.final(rid).finish_reason["type"] == "abort" and 0 < done < 50
    # The aborted request's computed KV is in the tree, pinned while its copy is in flight.
    m = tree.match(tree.root.key.__class__(prompt))
    assert m.device_indices.numel() == 40 and m.last_node.lock_ref > 0
    # A request needing the whole pool forces eviction: it must wait for the copy, not free it.
    big = _prompt(120, 2)
    other = h.submit(big, max_new_tokens=2)
    h.run()
    assert h.tokens(other) == reference_output(big, 2)
    assert h.stats()["copy_waits_under_pressure"] >= 1
    # The aborted request's KV is on the host: a resubmitted partial rollout reloads it.
    computed = h.runner.tokens_computed
    resumed = prompt + h.tokens(rid)
    again = h.submit(resumed, max_new_tokens=4)
    h.run()
    assert h.tokens(again) == reference_output(resumed, 4)
    assert h.final(again).cached_tokens >= 40
    assert h.runner.tokens_computed - computed < len(resumed) - 30
    assert h.stats()["loaded_back_tokens_total"] >= 40
    h.assert_idle_and_conserved()


def test_load_back_racing_an_abort(schedule_mode):
    # Loads take 100 ms: the request is aborted right after its admission started one.
    h = make_hi_harness(capacity=128, copy_hook=_slow({"load": 0.1}))
    prompt = _prompt(60, 4)
    first = h.submit(prompt, max_new_tokens=2)
    h.run()
    h.cache.evict(h.cache.capacity)  # everything host-only now
    h.check()
    assert h.tree.match(h.tree.root.key.__class__(prompt)).host_hit_length >= 60
    rid = h.submit(prompt + [5, 6, 7], max_new_tokens=20)
    h.step()  # admission: load back started, the forward waits for it
    assert h.tree.tier.ongoing_loads, "the load should be in flight"
    node = next(iter(h.tree.tier.ongoing_loads.values()))
    h.scheduler.abort(AbortReq(rid=rid))
    h.check()
    assert node.value is not None and node.lock_ref > 0  # still pinned by the load, not freed
    h.run()
    assert h.final(rid).finish_reason["type"] == "abort"
    assert node.lock_ref == 0
    # The loaded KV is intact: a later request reuses it from the device.
    again = h.submit(prompt + [9], max_new_tokens=3)
    h.run()
    assert h.tokens(again) == reference_output(prompt + [9], 3)
    assert h.final(again).cached_tokens >= 60
    assert h.tokens(first) == reference_output(prompt, 2)
    h.assert_idle_and_conserved()


def test_random_storm_with_aborts_and_slow_copies(schedule_mode):
    rng = random.Random(7)
    h = make_hi_harness(capacity=200, max_running=6, chunk=24,
                        copy_hook=_slow({"write": 0.002, "load": 0.002}))
    bases = [_prompt(30, 100 + i) for i in range(4)]
    live: list[str] = []
    expect: dict[str, list[int]] = {}
    for i in range(40):
        p = rng.choice(bases) + _prompt(rng.randrange(1, 20), i)
        n = rng.randrange(1, 16)
        rid = h.submit(p, max_new_tokens=n)
        live.append(rid)
        expect[rid] = reference_output(p, n)
        for _ in range(rng.randrange(0, 4)):
            h.step()
        if rng.random() < 0.3 and live:
            h.scheduler.abort(AbortReq(rid=rng.choice(live)))
            h.check()
    h.run()
    for rid in live:
        toks = h.tokens(rid)
        assert toks == expect[rid][:len(toks)]
        if h.final(rid).finish_reason["type"] != "abort":
            assert toks == expect[rid]
    h.assert_idle_and_conserved()


def test_flush_waits_for_copies_and_metrics_are_reported(schedule_mode):
    h = make_hi_harness(capacity=128, copy_hook=_slow({"write": 0.02}))
    rid = h.submit(_prompt(50, 9), max_new_tokens=3)
    while h.scheduler.step():
        h.check()
    info = h.scheduler.get_info()["hicache"]
    for key in ("host_capacity_tokens", "host_used_tokens", "backed_up_tokens_total",
                "loaded_back_tokens_total", "host_hit_rate", "device_hit_rate", "load_back_seconds_total",
                "pending_writes", "write_policy"):
        assert key in info
    assert info["host_capacity_tokens"] == 256 and info["backed_up_tokens_total"] >= 50
    assert h.scheduler.flush_cache()  # idle: flush waits for the write in flight
    assert h.tree.host_pool.used_size() == 0 and h.tokens(rid)
    h.check()
