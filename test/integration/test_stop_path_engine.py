"""The stop path through the Engine (real processes, tiny model): aborts from every entry
the Engine offers, held requests, timeouts, flush after abort_all, rid reuse, and a storm."""
from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest

from radixlm import Engine
from test.support.engine_checks import (abort_stream_after_three_chunks, assert_idle_and_empty, check_storm_outcomes,
                                random_prompt, run_storm)

GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    eng = Engine(model_path=tiny_llama_dir, dtype="float32", max_total_tokens=700, max_running_requests=24,
                 chunked_prefill_size=32, schedule_conservativeness=0.05, debug_check_integrity=True,
                 enable_overlap_schedule=True)  # the storm and abort paths must hold with overlap on
    yield eng
    eng.shutdown()


def test_abort_running_stream_returns_partial_output(engine):
    prompt = random_prompt(1, 20)
    abort_stream_after_three_chunks(engine, prompt, "victim")
    # the rid is free again at once, and a second abort of it is a no-op
    engine.abort_request("victim")
    again = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 4, **GREEDY}, rid="victim")
    assert again["meta_info"]["finish_reason"]["type"] == "length"
    assert_idle_and_empty(engine)


def test_requests_held_while_paused_are_never_admitted_when_aborted(engine):
    engine.pause_generation("in_place")
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault(
        "r", engine.generate(input_ids=random_prompt(2, 10), sampling_params={"max_new_tokens": 5}, rid="held")))
    t.start()
    deadline = time.monotonic() + 120
    while engine.get_server_info()["front_end"]["paused"] != 1:  # held in the tokenizer manager
        assert time.monotonic() < deadline, "the request was never held"
        time.sleep(0.01)
    assert engine.get_server_info()["num_waiting_reqs"] == 0
    engine.abort_request("held")
    t.join(10)
    engine.continue_generation()
    assert out["r"]["meta_info"]["finish_reason"]["type"] == "abort"
    assert out["r"]["output_ids"] == []
    assert_idle_and_empty(engine)


def test_timeout_is_503_with_partial_output(engine):
    out = engine.generate(input_ids=random_prompt(3, 10), sampling_params={"max_new_tokens": 2000, **GREEDY},
                          timeout=0.3)
    fr = out["meta_info"]["finish_reason"]
    assert fr["type"] == "abort" and fr["status_code"] == 503
    assert out["output_ids"]
    assert_idle_and_empty(engine)


def test_flush_right_after_abort_all_succeeds(engine):
    async def go():
        tasks = [asyncio.ensure_future(engine.async_generate(
            input_ids=random_prompt(10 + i, 30), sampling_params={"max_new_tokens": 300, **GREEDY}))
            for i in range(8)]
        await asyncio.sleep(0.3)
        engine.abort_request(abort_all=True)
        return await asyncio.gather(*tasks)
    outs = asyncio.run(go())
    assert all(o["meta_info"]["finish_reason"]["type"] == "abort" for o in outs)
    assert engine.flush_cache(timeout=10)
    assert_idle_and_empty(engine)


def test_storm(engine, tiny_llama_dir):
    """220+ requests on a small pool with random aborts, families and abort_all bursts; the
    reference is a run with no aborts and an ample pool."""
    rng = random.Random(11)
    specs = []
    for i in range(160):
        specs.append((f"q{i}", random_prompt(100 + i % 40, rng.randrange(5, 40)), rng.randrange(20, 90),
                      3 if i % 9 == 0 else 1))
    # Look-alikes of the families' rids (`q9_7`, `q9x`): they start after the last abort_all
    # burst and are never named by an abort, while their look-alike parents are: each must
    # run to its end, untouched.
    families = [rid for rid, _, _, fam in specs if fam > 1]
    lookalikes = [(f"{rid}{tail}", random_prompt(300 + i, 12), 40, 1)
                  for i, rid in enumerate(families[:6]) for tail in ("_7", "x")]
    specs += lookalikes
    reference = {}
    prompts = [p for _, p, _, _ in specs]
    with Engine(model_path=tiny_llama_dir, dtype="float32", max_total_tokens=20000) as ample:
        ref_outs = ample.generate(input_ids=prompts, sampling_params=[{"max_new_tokens": n, "temperature": 0}
                                                                      for _, _, n, _ in specs])
    for (rid, _, _, _), o in zip(specs, ref_outs):
        reference[rid] = o["output_ids"]

    async def one(rid, prompt, n, fam):
        # EOS is not ignored: running requests then reserve only new_token_ratio of their
        # remaining budget, so the small pool overcommits and retractions happen.
        params = {"max_new_tokens": n, "temperature": 0, "n": fam}
        if fam == 1 and rng.random() < 0.5:
            got = []
            agen = await engine.async_generate(input_ids=prompt, sampling_params=params, rid=rid, stream=True)
            async for chunk in agen:
                got.append(chunk)
            ids = [t for c in got for t in c["output_ids"]]
            return [(rid, ids, got[-1]["meta_info"])]
        res = await engine.async_generate(input_ids=prompt, sampling_params=params, rid=rid)
        res = res if isinstance(res, list) else [res]
        return [(r["meta_info"]["id"], r["output_ids"], r["meta_info"]) for r in res]

    late: list[asyncio.Future] = []

    async def chaos():
        named = [s for s in specs if s not in lookalikes]
        for k in range(60):
            await asyncio.sleep(rng.random() * 0.1)
            if k in (25, 50):  # two bursts that hit whatever is live at that moment
                engine.abort_request(abort_all=True)
            elif k > 50:  # the families' parents, with their look-alikes running beside them
                n_hit = engine.abort_request(rng.choice(families))
                assert n_hit <= 3, n_hit  # a family's own children at most
            else:
                engine.abort_request(rng.choice(named)[0])
            if k == 50:
                late.extend(asyncio.ensure_future(one(*s)) for s in lookalikes)

    results = run_storm(one, [s for s in specs if s not in lookalikes], chaos, late)
    aborted = check_storm_outcomes(results, reference, sum(f for *_, f in specs),
                                   untouched={r for r, *_ in lookalikes})
    assert aborted > 0
    info = engine.get_server_info()
    assert info["cancel_latency_s"]["count"] > 0
    assert info["num_retractions"] > 0, "the pool was meant to be small enough to force retractions"
    assert_idle_and_empty(engine)


def test_a_dead_scheduler_fails_requests_instead_of_hanging(tiny_llama_dir):
    import os
    import signal
    eng = Engine(model_path=tiny_llama_dir, dtype="float32", max_total_tokens=512)
    try:
        stream = eng.generate(input_ids=random_prompt(9, 10), sampling_params={"max_new_tokens": 2000, **GREEDY},
                              stream=True)
        next(stream)
        os.kill(eng.procs.procs["scheduler"].pid, signal.SIGKILL)
        chunks = list(stream)
        fr = chunks[-1]["meta_info"]["finish_reason"]
        assert fr["type"] == "abort" and fr["status_code"] == 500 and "scheduler" in fr["message"]
        with pytest.raises(RuntimeError, match="down"):
            eng.generate(input_ids=[1, 2], sampling_params={"max_new_tokens": 1})
    finally:
        eng.shutdown()
