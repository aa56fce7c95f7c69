"""Checks and workloads shared by the tests that drive a real Engine (tiny random model):
KV conservation after a scenario, random prompts, and the multi-turn workload the HiCache
tests run with and without the host tier."""
from __future__ import annotations

import asyncio
import random
import time

from radixlm import Engine


def random_prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49000) for _ in range(n)]


def assert_kv_conserved(eng: Engine) -> dict:
    """Integrity holds, nothing is protected, and every slot is free or evictable (no live
    request holds KV). Returns the server info it read."""
    eng.check_integrity()
    info = eng.get_server_info()
    mem = info["memory"]
    assert mem["protected"] == 0 and mem["free"] + mem["evictable"] == mem["capacity"]
    return info


def assert_idle_and_empty(eng: Engine) -> None:
    """After a flush: no request running or waiting and every KV slot free."""
    assert eng.flush_cache(timeout=10)  # idle, then empty
    eng.check_integrity()
    info = eng.get_server_info()
    mem = info["memory"]
    assert info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0
    assert mem["free"] == mem["capacity"] and mem["protected"] == 0


def abort_stream_after_three_chunks(engine: Engine, prompt: list[int], rid: str) -> None:
    """Stream a long greedy request, abort it by rid at its third chunk, and check the abort:
    the final chunk says so, and the tokens delivered are exactly what the same request
    computes undisturbed (a greedy prefix; any KV it reused came from the aborted one)."""
    greedy = {"temperature": 0, "ignore_eos": True}
    chunks = []
    for chunk in engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 500, **greedy},
                                 stream=True, rid=rid):
        chunks.append(chunk)
        if len(chunks) == 3:
            engine.abort_request(rid)
    final = chunks[-1]["meta_info"]
    assert final["finish_reason"]["type"] == "abort"
    assert 3 <= final["completion_tokens"] < 500
    redo = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": final["completion_tokens"],
                                                              **greedy})
    assert [t for c in chunks for t in c["output_ids"]] == redo["output_ids"]


def run_storm(one, specs: list[tuple], chaos, late: list | None = None) -> list:
    """Every spec through the coroutine `one(*spec)` (which returns a list of results) while
    the coroutine `chaos()` runs; all the results, flattened. `late`: futures that `chaos`
    starts as it goes, gathered with the others."""
    late = [] if late is None else late

    async def go() -> list:
        tasks = [asyncio.ensure_future(one(*s)) for s in specs]
        await chaos()
        return [x for r in await asyncio.gather(*tasks, *late) for x in r]
    return asyncio.run(go())


def check_storm_outcomes(results: list[tuple[str, list[int], dict]], reference: dict[str, list[int]],
                         expected: int, untouched: set[str] = frozenset()) -> int:
    """A storm's (rid, output ids, meta_info) per request against the undisturbed outputs by rid
    (n > 1 children `rid_i` share their parent's): every request answered once, with as many
    ids as it reports; survivors exactly the reference, aborted ones a prefix of it; the rids in
    `untouched` (no abort named them) finish by length. Returns how many were aborted."""
    assert len(results) == expected
    aborted = 0
    for rid, ids, meta in results:
        ref = reference[rid if rid in reference else rid.rsplit("_", 1)[0]]
        assert meta["completion_tokens"] == len(ids)
        if rid in untouched:
            assert meta["finish_reason"]["type"] == "length" and ids == ref, rid
        if meta["finish_reason"]["type"] == "abort":
            aborted += 1
            assert ids == ref[:len(ids)], rid  # a prefix of the undisturbed output
        else:
            assert ids == ref, rid  # survivors: exactly the undisturbed output
    return aborted


def multiturn(engine: Engine, convs: int, turns: int, user_len: int = 40, max_new: int = 6) -> list[list[int]]:
    """`convs` greedy conversations of `turns` turns, each turn the whole history plus
    `user_len` new random ids; returns every turn's output ids."""
    rng = random.Random(11)
    history: list[list[int]] = [[] for _ in range(convs)]
    outputs = []
    for _ in range(turns):
        prompts = [history[c] + [rng.randrange(3, 49000) for _ in range(user_len)] for c in range(convs)]
        res = engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": max_new, "temperature": 0,
                                                                  "ignore_eos": True})
        for c, r in enumerate(res):
            history[c] = prompts[c] + r["output_ids"]
            outputs.append(r["output_ids"])
    return outputs


def run_multiturn(model_dir: str, convs: int, turns: int, **engine_kw) -> tuple[list[list[int]], dict]:
    """multiturn() on a fresh float32 Engine (64-token prefill chunks, integrity checked every
    iteration); returns its outputs and the server info once HiCache's last backups are acked."""
    eng = Engine(model_path=model_dir, dtype="float32", chunked_prefill_size=64, debug_check_integrity=True,
                 **engine_kw)
    try:
        outs = multiturn(eng, convs, turns)
        eng.check_integrity()
        info = eng.get_server_info()
        deadline = time.time() + 10
        while info.get("hicache", {}).get("pending_writes") and time.time() < deadline:
            time.sleep(0.05)  # the loop acks the last copies on its next iterations
            info = eng.get_server_info()
        return outs, info
    finally:
        eng.shutdown()
