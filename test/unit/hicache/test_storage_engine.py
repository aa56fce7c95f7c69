"""The storage tier end to end: a long prompt computed by one Engine (tiny random Llama, real KV
tensors) is stored in the `file` tier; a second Engine started after the first has exited finds
it there, prefetches it into host memory and loads it back: greedy output identical, the
prompt's cached tokens counted, all of them from storage (the second Engine started empty)."""
from __future__ import annotations

import time

from radixlm import Engine

from test.support.engine_checks import random_prompt

SAMPLING = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


def _engine(model_dir: str, storage_dir: str) -> Engine:
    return Engine(model_path=model_dir, dtype="float32", chunked_prefill_size=64, debug_check_integrity=True,
                  max_total_tokens=1024, enable_hierarchical_cache=True, hicache_storage_backend="file",
                  hicache_storage_dir=storage_dir, hicache_storage_prefetch_policy="wait_complete",
                  hicache_storage_prefetch_threshold=64)


def _storage_info(eng: Engine, done) -> dict:
    """The storage counters once `done(counters)` holds (backups finish on their own thread)."""
    deadline = time.time() + 60
    while True:
        info = eng.get_server_info()["hicache"]["storage"]
        if done(info) or time.time() > deadline:
            return info
        time.sleep(0.05)


def test_prefix_stored_by_one_engine_is_loaded_by_the_next(tiny_llama_dir, tmp_path):
    prompt = random_prompt(5, 300)
    first = _engine(tiny_llama_dir, str(tmp_path))
    try:
        ref = first.generate(input_ids=prompt, sampling_params=SAMPLING)
        assert ref["meta_info"]["cached_tokens"] == 0
        info = _storage_info(first, lambda s: s["backup_pages_written"] >= 4 and not s["pending_backup_pages"])
        assert info["backup_pages_written"] >= 4 and info["backend_errors"] == 0
        first.check_integrity()
    finally:
        first.shutdown()

    second = _engine(tiny_llama_dir, str(tmp_path))
    try:
        out = second.generate(input_ids=prompt, sampling_params=SAMPLING)
        assert out["output_ids"] == ref["output_ids"]
        assert out["meta_info"]["cached_tokens"] == 256  # 4 stored pages of 64 tokens
        info = second.get_server_info()["hicache"]
        s = info["storage"]
        assert s["prefetched_pages"] == 4 and s["storage_hit_tokens"] == 256 and s["prefetch_waits"] == 1
        assert info["loaded_back_tokens_total"] == 256
        # Another prompt sharing the prefix reuses it from the device now.
        longer = second.generate(input_ids=prompt + random_prompt(6, 20), sampling_params=SAMPLING)
        assert longer["meta_info"]["cached_tokens"] >= 256
        second.check_integrity()
    finally:
        second.shutdown()
