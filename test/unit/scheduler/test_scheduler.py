"""Scheduler behaviour over real pools and a real radix cache, with a KV-checking fake model."""
from __future__ import annotations

import random

import pytest

from radixlm.messages import AbortReq

from test.support.fake_runner import reference_output
from test.support.scheduler_harness import make_harness


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(97) for _ in range(n)]


def test_single_request_runs_to_length_and_returns_all_kv():
    h = make_harness()
    prompt = _prompt(20, 1)
    rid = h.submit(prompt, max_new_tokens=10)
    h.run()
    assert h.tokens(rid) == reference_output(prompt, 10)
    fin = h.final(rid)
    assert fin.finish_reason == {"type": "length", "length": 10}
    assert fin.prompt_tokens == 20 and fin.completion_tokens == 10
    h.assert_idle_and_conserved()
    # prompt + all but the last output token are cached for reuse
    assert h.cache.evictable() == 20 + 10 - 1


def test_prefix_reuse_reports_cached_tokens_and_skips_compute():
    h = make_harness()
    shared = _prompt(100, 2)
    a = h.submit(shared + [1, 2, 3], max_new_tokens=4)
    h.run()
    before = h.runner.tokens_computed
    b = h.submit(shared + [4, 5, 6], max_new_tokens=4)
    h.run()
    assert h.final(b).cached_tokens >= 100
    # the second prefill computed only the unshared tail (plus decode steps)
    assert h.runner.tokens_computed - before == 3 + 3
    assert h.tokens(b) == reference_output(shared + [4, 5, 6], 4)
    assert h.final(a).cached_tokens == 0
    h.assert_idle_and_conserved()


@pytest.mark.parametrize("chunk", [7, 16, 64])
def test_chunked_prefill_matches_unchunked(chunk):
    prompts = [_prompt(n, n) for n in (5, 50, 130)]
    h = make_harness(chunk=chunk)
    rids = [h.submit(p, max_new_tokens=6) for p in prompts]
    h.run()
    for rid, p in zip(rids, prompts):
        assert h.tokens(rid) == reference_output(p, 6)
        h.final(rid)
    # no extend chunk was larger than the chunk size
    assert all(max(b.extend_lens) <= chunk for b in h.runner.forward_calls if not b.is_decode)
    h.assert_idle_and_conserved()


def test_continuous_batching_mixes_arrivals():
    h = make_harness()
    p1, p2 = _prompt(10, 3), _prompt(12, 4)
    r1 = h.submit(p1, max_new_tokens=30)
    for _ in range(5):
        h.scheduler.step()
    r2 = h.submit(p2, max_new_tokens=5)
    h.run()
    assert h.tokens(r1) == reference_output(p1, 30)
    assert h.tokens(r2) == reference_output(p2, 5)
    decode_sizes = [len(b.reqs) for b in h.runner.forward_calls if b.is_decode]
    assert max(decode_sizes) == 2
    h.assert_idle_and_conserved()


@pytest.mark.parametrize("policy", ["fcfs", "lpm", "dfs-weight", "lof", "random"])
def test_every_policy_completes_a_shared_prefix_workload(policy):
    h = make_harness(schedule_policy=policy, capacity=1024)
    base = _prompt(40, 5)
    prompts = [base + _prompt(8, 100 + i) for i in range(6)] + [_prompt(30, 200 + i) for i in range(4)]
    rids = [h.submit(p, max_new_tokens=8) for p in prompts]
    h.run()
    for rid, p in zip(rids, prompts):
        assert h.tokens(rid) == reference_output(p, 8)
    h.assert_idle_and_conserved()


def test_in_batch_dedup_computes_a_shared_prefix_once():
    h = make_harness()
    base = _prompt(200, 6)
    rids = [h.submit(base + [i], max_new_tokens=2) for i in range(5)]
    h.run()
    prefill_tokens = sum(sum(b.extend_lens) for b in h.runner.forward_calls if not b.is_decode)
    assert prefill_tokens == 201 + 4 * 1
    assert all(h.final(r).cached_tokens == 200 for r in rids[1:])
    h.assert_idle_and_conserved()


def test_in_batch_dedup_takes_a_short_shared_system_prompt_once():
    """Chat prompts behind one short system prompt (20 of ~30 tokens: under the 32-token
    threshold, over half of each prompt): the first computes it, the rest wait a round and hit
    the cache; a prompt that shares less than half of itself is not held back."""
    h = make_harness()
    system = _prompt(20, 9)
    prompts = [system + _prompt(8 + i, 40 + i) for i in range(4)]
    other = _prompt(10, 70)
    rids = [h.submit(p, max_new_tokens=3) for p in prompts]
    lone = h.submit(system[:4] + other, max_new_tokens=3)  # 4 of 14 shared: admitted at once
    h.run()
    prefills = [b for b in h.runner.forward_calls if not b.is_decode]
    assert sum(sum(b.extend_lens) for b in prefills) == 28 + sum(8 + i for i in range(1, 4)) + 14
    assert len(prefills[0].reqs) == 2  # the first chat prompt and the lone one
    assert all(h.final(r).cached_tokens == 20 for r in rids[1:])
    for rid, p in zip(rids + [lone], prompts + [system[:4] + other]):
        assert h.tokens(rid) == reference_output(p, 3)
    h.assert_idle_and_conserved()


def test_retraction_under_kv_pressure_keeps_streams_continuous():
    h = make_harness(capacity=160, max_running=8)
    prompts = [_prompt(20, 300 + i) for i in range(6)]
    rids = [h.submit(p, max_new_tokens=40, stream=True) for p in prompts]
    h.run()
    assert h.scheduler.stats.num_retractions > 0
    for rid, p in zip(rids, prompts):
        assert h.tokens(rid) == reference_output(p, 40)  # no token twice, none lost
        assert h.final(rid).finish_reason["type"] == "length"
    assert max(h.final(r).num_retractions for r in rids) >= 1
    h.assert_idle_and_conserved()


def test_single_request_that_cannot_fit_is_aborted_with_500():
    h = make_harness(capacity=40, max_running=4)
    rid = h.submit(_prompt(30, 7), max_new_tokens=100, ignore_eos=True)
    h.run()
    fin = h.final(rid)
    assert fin.finish_reason["type"] == "abort" and fin.finish_reason["status_code"] == 500
    assert "out of memory" in fin.finish_reason["message"]
    h.assert_idle_and_conserved()


def test_disable_radix_cache_computes_everything():
    h = make_harness(disable_cache=True)
    p = _prompt(50, 8)
    r1 = h.submit(p, max_new_tokens=3)
    h.run()
    r2 = h.submit(p, max_new_tokens=3)
    h.run()
    assert h.final(r2).cached_tokens == 0
    assert h.tokens(r1) == h.tokens(r2) == reference_output(p, 3)
    assert h.cache.available() == h.cache.capacity
    h.assert_idle_and_conserved()


def test_stop_token_ids_and_min_new_tokens():
    p = _prompt(10, 9)
    ref = reference_output(p, 20)
    stop = ref[3]
    first = ref.index(stop)
    h = make_harness()
    r1 = h.submit(p, max_new_tokens=20, stop_token_ids=[stop])
    r2 = h.submit(p, max_new_tokens=20, stop_token_ids=[stop], min_new_tokens=first + 2)
    h.run()
    assert h.tokens(r1) == ref[:first + 1]
    assert h.final(r1).finish_reason == {"type": "stop", "matched": stop}
    later = [i for i, t in enumerate(ref) if t == stop and i + 1 >= first + 2]
    expect = ref[:later[0] + 1] if later else ref
    assert h.tokens(r2) == expect
    h.assert_idle_and_conserved()


def test_eos_ends_unless_ignore_eos():
    p = _prompt(10, 10)
    ref = reference_output(p, 30)
    h = make_harness(eos=(ref[5],))
    r1 = h.submit(p, max_new_tokens=30)
    r2 = h.submit(p, max_new_tokens=30, ignore_eos=True)
    h.run()
    assert h.tokens(r1) == ref[:ref.index(ref[5]) + 1]
    assert h.tokens(r2) == ref
    h.assert_idle_and_conserved()


def test_max_new_tokens_zero_prefills_and_caches():
    h = make_harness()
    p = _prompt(30, 11)
    rid = h.submit(p, max_new_tokens=0)
    h.run()
    assert h.tokens(rid) == []
    assert h.final(rid).finish_reason["type"] == "length"
    assert h.cache.evictable() == 30  # the whole prompt was computed and is reusable
    h.assert_idle_and_conserved()


def test_bad_requests_are_answered_with_400_and_others_run():
    h = make_harness(context=64)
    good = h.submit(_prompt(10, 12), max_new_tokens=3)
    empty = h.submit([], max_new_tokens=3)
    long = h.submit(_prompt(100, 13), max_new_tokens=3)
    oov = h.submit([1, 2, 500], max_new_tokens=3)
    h.run()
    for rid in (empty, long, oov):
        fr = h.final(rid).finish_reason
        assert fr["type"] == "abort" and fr["status_code"] == 400
    assert len(h.tokens(good)) == 3
    h.assert_idle_and_conserved()


@pytest.mark.parametrize("where", ["waiting", "running", "chunked"])
def test_abort_in_each_place_gives_one_terminal_output(where):
    h = make_harness(chunk=8)
    p = _prompt(40 if where == "chunked" else 10, 14)
    other = h.submit(_prompt(12, 15), max_new_tokens=5)
    rid = h.submit(p, max_new_tokens=50, stream=True)
    if where != "waiting":
        for _ in range(3 if where == "chunked" else 8):
            h.scheduler.step()
        assert h.where(rid) == where
    h.scheduler.abort(AbortReq(rid=rid))
    h.run()
    fin = h.final(rid)
    assert fin.finish_reason["type"] == "abort"
    assert h.tokens(rid) == reference_output(p, 50)[:len(h.tokens(rid))]
    assert len(h.tokens(other)) == 5
    h.assert_idle_and_conserved()


@pytest.mark.parametrize("msg,hit", [
    (AbortReq(rid="job"), {"job"}),  # exact: the shape of a rid never makes a family
    (AbortReq(rid="job", prefix=True), {"job", "job_0", "job_1", "jobs", "job_x"}),
    (AbortReq(rids=["job_0", "jobs"]), {"job_0", "jobs"}),  # exact rids (how the front end sends families)
])
def test_abort_names_exact_rids_or_an_explicit_prefix(msg, hit):
    h = make_harness()
    ids = [h.submit(_prompt(5, 16), rid=r, max_new_tokens=5) for r in ("job", "job_0", "job_1", "jobs", "job_x")]
    h.scheduler.abort(msg)
    h.run()
    kinds = {r: h.final(r).finish_reason["type"] for r in ids}
    assert kinds == {r: "abort" if r in hit else "length" for r in ids}


def test_flush_cache_only_when_idle():
    h = make_harness()
    h.submit(_prompt(20, 17), max_new_tokens=3)
    assert h.scheduler.flush_cache() is False
    h.run()
    assert h.cache.evictable() > 0
    assert h.scheduler.flush_cache() is True
    assert h.cache.available() == h.cache.capacity
    h.assert_idle_and_conserved()


@pytest.mark.parametrize("page_size", [1, 4])
def test_random_workload_with_small_pool(page_size):
    rng = random.Random(page_size)
    h = make_harness(capacity=256, max_running=6, chunk=16, page_size=page_size)
    bases = [_prompt(rng.randrange(5, 40), 400 + i) for i in range(3)]
    expect = {}
    for i in range(25):
        p = rng.choice(bases) + _prompt(rng.randrange(1, 20), 500 + i)
        n = rng.randrange(1, 30)
        expect[h.submit(p, max_new_tokens=n, stream=bool(i % 2))] = reference_output(p, n)
        for _ in range(rng.randrange(0, 4)):
            h.scheduler.step()
            h.scheduler.check_integrity()
    h.run()
    for rid, ref in expect.items():
        assert h.tokens(rid) == ref
        h.final(rid)
    h.assert_idle_and_conserved()


@pytest.mark.parametrize("interleave", [True, False])
def test_a_long_prompt_does_not_starve_decoding_requests(interleave):
    """Between the chunks of a long prompt the decoding requests get a step (without it one 8k
    prompt held 16 streams for 40 s); with the interleave off, they wait for the whole prompt."""
    h = make_harness(chunk=8, disable_chunked_prefill_interleave=not interleave)
    short = [_prompt(5, 40 + i) for i in range(2)]
    decoding = [h.submit(p, max_new_tokens=30) for p in short]
    for _ in range(4):
        h.scheduler.step()
    assert all(h.tokens(r) for r in decoding)  # both are decoding
    long_prompt = _prompt(64, 50)  # 8 chunks
    calls_before = len(h.runner.forward_calls)
    tokens_before = [len(h.tokens(r)) for r in decoding]
    long_rid = h.submit(long_prompt, max_new_tokens=3)
    while not h.outputs.get(long_rid) or not h.tokens(long_rid):
        h.scheduler.step()
    calls = h.runner.forward_calls[calls_before:]
    chunks = [b for b in calls if not b.is_decode]
    assert len(chunks) == 8
    gained = [len(h.tokens(r)) - n for r, n in zip(decoding, tokens_before)]
    if interleave:
        # a decode step between every two chunks: the streams kept moving
        kinds = "".join("d" if b.is_decode else "p" for b in calls)
        assert "pp" not in kinds, kinds
        assert all(g >= 7 for g in gained), gained
    else:
        assert all(g <= 2 for g in gained), gained
    h.run()
    assert h.tokens(long_rid) == reference_output(long_prompt, 3)
    for r, p in zip(decoding, short):
        assert h.tokens(r) == reference_output(p, 30)
    h.assert_idle_and_conserved()
