"""HiCache end to end: the real Engine (processes, tiny random Llama, real KV tensors copied
between the device pool and the host pool) gives the same greedy outputs with and without the
host tier on a multi-turn workload several times the device pool, with check_integrity after
every scheduler iteration (debug_check_integrity)."""
from __future__ import annotations

from test.support.engine_checks import run_multiturn

DEVICE_TOKENS = 192


def test_engine_greedy_outputs_identical_with_hicache(tiny_llama_dir):
    ref, ref_info = run_multiturn(tiny_llama_dir, 4, 4, max_total_tokens=DEVICE_TOKENS)
    outs, info = run_multiturn(tiny_llama_dir, 4, 4, max_total_tokens=DEVICE_TOKENS, enable_hierarchical_cache=True)
    assert outs == ref
    hc = info["hicache"]
    assert hc["loaded_back_tokens_total"] > 0 and hc["backed_up_tokens_total"] > 0 and hc["host_hit_rate"] > 0
    assert hc["host_capacity_tokens"] == 2 * DEVICE_TOKENS
    assert info["num_prefill_tokens"] < ref_info["num_prefill_tokens"]  # reloaded, not recomputed
    mem = info["memory"]
    assert mem["protected"] == 0 and mem["free"] + mem["evictable"] == mem["capacity"]
    assert "hicache" not in ref_info
