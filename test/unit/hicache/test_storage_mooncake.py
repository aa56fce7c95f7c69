"""The `mooncake` storage backend against a real Mooncake Store: a `mooncake_master` started on
127.0.0.1 by the test (stopped by its process id). A prefix computed by one scheduler is served
from the store to another; a master killed mid-run costs recomputation only. Skipped, with the
reason, where `mooncake.store` cannot be imported (PyPI: mooncake-transfer-engine-non-cuda,
which needs Debian's libibverbs1)."""
from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import time

import pytest

from radixlm.hicache.storage_mooncake import mooncake_import_error

from test.support.fake_runner import reference_output
from test.support.hicache_harness import make_hi_harness

WHY = mooncake_import_error()
pytestmark = pytest.mark.skipif(WHY is not None, reason=str(WHY))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def master(tmp_path):
    import mooncake

    binary = os.path.join(os.path.dirname(mooncake.__file__), "mooncake_master")
    port = _free_port()
    proc = subprocess.Popen([binary, f"--rpc_port={port}", "--rpc_address=127.0.0.1",
                             f"--metrics_port={_free_port()}", "--enable_metric_reporting=false"],
                            stdout=open(tmp_path / "master.log", "w"), stderr=subprocess.STDOUT)
    deadline = time.time() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), 0.5).close()
            break
        except OSError:
            assert proc.poll() is None and time.time() < deadline, (tmp_path / "master.log").read_text()
            time.sleep(0.05)
    yield proc, f"127.0.0.1:{port}"
    if proc.poll() is None:
        proc.terminate()
        proc.wait(30)


def _harness(address: str, policy: str = "wait_complete"):
    extra = json.dumps({"master_server_address": address, "global_segment_size": 32 << 20,
                        "local_buffer_size": 16 << 20})
    return make_hi_harness(capacity=512, storage={
        "hicache_storage_backend": "mooncake", "hicache_storage_backend_extra_config": extra,
        "hicache_storage_prefetch_policy": policy, "hicache_storage_prefetch_threshold": 64})


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(97) for _ in range(n)]


def test_prefix_computed_on_one_scheduler_is_served_to_another(master):
    _, address = master
    a, b = _harness(address), _harness(address)
    prompt = _prompt(300, 1)
    first = a.submit(prompt, max_new_tokens=3)
    a.run()
    a.settle()
    assert a.stats()["storage"]["backup_pages_written"] == 4
    rid = b.submit(prompt + [5], max_new_tokens=3)
    b.run()
    assert b.tokens(rid) == reference_output(prompt + [5], 3) and a.tokens(first) == reference_output(prompt, 3)
    assert b.final(rid).cached_tokens == 256
    s = b.stats()["storage"]
    assert s["prefetched_pages"] == 4 and s["backend_errors"] == 0 and s["storage_backend"] == "mooncake"
    b.settle()
    for h in (a, b):
        h.assert_idle_and_conserved()
        h.tree.storage.close()


def test_master_killed_mid_run_degrades_to_recomputation(master):
    proc, address = master
    a, b = _harness(address), _harness(address)
    prompt = _prompt(256, 2)
    a.submit(prompt, max_new_tokens=2)
    a.run()
    a.settle()
    warm = b.submit(_prompt(128, 3), max_new_tokens=2)  # b's client connects and stores
    b.run()
    b.settle()
    assert b.stats()["storage"]["backup_pages_written"] == 2
    proc.kill()
    proc.wait(30)
    rid = b.submit(prompt + [1], max_new_tokens=4)
    b.run()  # the prefetch fails (after the client's own timeout), the prompt is recomputed
    b.settle()
    assert b.tokens(rid) == reference_output(prompt + [1], 4)
    assert b.tokens(warm) == reference_output(_prompt(128, 3), 2)
    s = b.stats()["storage"]
    assert b.final(rid).cached_tokens == 0 and s["backend_errors"] >= 1 and s["prefetched_pages"] == 0
    b.assert_idle_and_conserved()
    a.assert_idle_and_conserved()


def test_two_engines_share_a_prefix_through_mooncake_store(master, tiny_llama_dir):
    from radixlm import Engine

    from test.support.engine_checks import random_prompt

    _, address = master
    extra = json.dumps({"master_server_address": address, "global_segment_size": 32 << 20,
                        "local_buffer_size": 16 << 20})
    kw = dict(model_path=tiny_llama_dir, dtype="float32", chunked_prefill_size=64, debug_check_integrity=True,
              max_total_tokens=1024, enable_hierarchical_cache=True, hicache_storage_backend="mooncake",
              hicache_storage_backend_extra_config=extra, hicache_storage_prefetch_policy="wait_complete",
              hicache_storage_prefetch_threshold=64)
    sampling = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    prompt = random_prompt(7, 300)
    first = Engine(**kw)
    try:
        ref = first.generate(input_ids=prompt, sampling_params=sampling)
        deadline = time.time() + 60
        while first.get_server_info()["hicache"]["storage"]["backup_pages_written"] < 4 and time.time() < deadline:
            time.sleep(0.05)  # backups run on the storage tier's thread
        second = Engine(**kw)  # the first still holds the pages in its client segment
        try:
            out = second.generate(input_ids=prompt, sampling_params=sampling)
            assert out["output_ids"] == ref["output_ids"]
            assert out["meta_info"]["cached_tokens"] == 256
            s = second.get_server_info()["hicache"]["storage"]
            assert s["prefetched_pages"] == 4 and s["backend_errors"] == 0
            second.check_integrity()
        finally:
            second.shutdown()
    finally:
        first.shutdown()
