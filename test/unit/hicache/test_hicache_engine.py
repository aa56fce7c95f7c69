"""HiCache end to end: the real Engine (processes, tiny random Llama, real KV tensors copied
between the device pool and the host pool) gives the same greedy outputs with and without the
host tier on a multi-turn workload several times the device pool, with check_integrity after
every scheduler iteration (debug_check_integrity)."""
from __future__ import annotations

import random
import time

from radixlm import Engine

DEVICE_TOKENS = 192


def _multiturn(engine: Engine, convs: int = 4, turns: int = 4, user_len: int = 40, max_new: int = 6) -> list[list[int]]:
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


def _run(model_dir: str, **kw) -> tuple[list[list[int]], dict]:
    eng = Engine(model_path=model_dir, dtype="float32", max_total_tokens=DEVICE_TOKENS, chunked_prefill_size=64,
                 debug_check_integrity=True, **kw)
    try:
        outs = _multiturn(eng)
        eng.check_integrity()
        info = eng.get_server_info()
        deadline = time.time() + 10
        while info.get("hicache", {}).get("pending_writes") and time.time() < deadline:
            time.sleep(0.05)  # the loop acks the last copies on its next iterations
            info = eng.get_server_info()
        return outs, info
    finally:
        eng.shutdown()


def test_engine_greedy_outputs_identical_with_hicache(tiny_llama_dir):
    ref, ref_info = _run(tiny_llama_dir)
    outs, info = _run(tiny_llama_dir, enable_hierarchical_cache=True)
    assert outs == ref
    hc = info["hicache"]
    assert hc["loaded_back_tokens_total"] > 0 and hc["backed_up_tokens_total"] > 0 and hc["host_hit_rate"] > 0
    assert hc["host_capacity_tokens"] == 2 * DEVICE_TOKENS
    assert info["num_prefill_tokens"] < ref_info["num_prefill_tokens"]  # reloaded, not recomputed
    mem = info["memory"]
    assert mem["protected"] == 0 and mem["free"] + mem["evictable"] == mem["capacity"]
    assert "hicache" not in ref_info
