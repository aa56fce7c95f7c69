"""HiCache's storage tier under the real Scheduler with the fake model (whose KV is token ids,
so every prefetched page is checked against its node's tokens after every step): pages stored
by one scheduler are prefetched by a fresh one over the same directory, each prefetch policy,
an abort while a prefetch is in flight (sglang#31296), prefetched host copies under a
device-only parent (sglang#30106/#31902), and the faults (unwritable directory, corrupt page,
a backend that blocks): requests recompute, nothing leaks."""
from __future__ import annotations

import os
import random
import threading

import pytest
import torch

from radixlm.hicache.storage import CorruptPage, decode_page, encode_page, namespace_seed, page_keys
from radixlm.hicache.storage_file import FileStorage
from radixlm.messages import AbortReq
from radixlm.radix_cache.prefix_cache import RadixKey

from test.support.fake_runner import reference_output
from test.support.hicache_harness import HiHarness, make_hi_harness

PAGE = 64  # storage page tokens at page_size 1


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(97) for _ in range(n)]


def _storage(d, policy: str = "wait_complete", threshold: int = 64, timeout: float = 2.0) -> dict:
    return {"hicache_storage_backend": "file", "hicache_storage_dir": str(d),
            "hicache_storage_prefetch_policy": policy, "hicache_storage_prefetch_threshold": threshold,
            "hicache_storage_prefetch_timeout": timeout}


def _harness(d, **kw) -> HiHarness:
    storage = kw.pop("storage", None) or _storage(d)
    return make_hi_harness(capacity=kw.pop("capacity", 512), storage=storage, **kw)


def _store(d, prompt: list[int], **kw) -> HiHarness:
    """A first scheduler computes `prompt` and stores its pages."""
    h = _harness(d, **kw)
    rid = h.submit(prompt, max_new_tokens=2)
    h.run()
    h.settle()
    assert h.tokens(rid) == reference_output(prompt, 2)
    assert h.stats()["storage"]["backup_pages_written"] == len(prompt) // PAGE
    return h


class GatedFileStorage(FileStorage):
    """File storage whose reads wait for `gate` (a slow or dead backend); bounded so that a
    broken test fails instead of hanging."""

    def __init__(self, directory: str) -> None:
        super().__init__(directory)
        self.gate = threading.Event()
        self.reading = threading.Event()

    def exists(self, key: str) -> bool:
        self.reading.set()
        if not self.gate.wait(60):
            raise TimeoutError("gate never opened")
        return super().exists(key)


def _gate(h: HiHarness) -> GatedFileStorage:
    st = h.tree.storage
    gated = GatedFileStorage(st.backend.directory)
    st.backend = gated
    return gated


def test_page_format_and_keys():
    like = [torch.zeros(1, 3)]
    rows = [torch.arange(12.0).reshape(4, 3)]
    blob = encode_page("ab" * 16, rows)
    assert decode_page("ab" * 16, blob, like, 4)[0].tolist() == rows[0].tolist()
    with pytest.raises(CorruptPage):
        decode_page("cd" * 16, blob, like, 4)  # another page's name
    bad = bytearray(blob)
    bad[-1] ^= 1
    with pytest.raises(CorruptPage):
        decode_page("ab" * 16, bytes(bad), like, 4)
    with pytest.raises(CorruptPage):
        decode_page("ab" * 16, blob[:-3], like, 4)
    toks = list(range(10))
    seed = namespace_seed("m", "l", None)
    keys = page_keys(toks, 4, seed)
    assert len(keys) == 2 and page_keys(toks[:4], 4, seed) == keys[:1]
    assert page_keys([9] + toks[1:], 4, seed)[1] != keys[1]  # chained: page 1 depends on page 0
    assert page_keys(toks, 4, namespace_seed("m", "l", "v2")) != keys  # weight version / extra key
    assert page_keys(toks, 4, namespace_seed("other", "l", None)) != keys


@pytest.mark.parametrize("page_size", [1, 4])
def test_second_scheduler_loads_the_prefix_from_storage(tmp_path, schedule_mode, page_size):
    prompt = _prompt(300, 1)
    _store(tmp_path, prompt, page_size=page_size)
    assert FileStorage(str(tmp_path)).num_pages() == 4
    h = _harness(tmp_path, page_size=page_size)  # a fresh scheduler: empty device and host tiers
    follow = prompt + _prompt(20, 2)
    rid = h.submit(follow, max_new_tokens=5)
    h.run()
    assert h.tokens(rid) == reference_output(follow, 5)
    s = h.stats()
    assert s["storage"]["prefetched_pages"] == 4 and s["storage"]["prefetch_waits"] == 1
    assert h.final(rid).cached_tokens == 256  # four stored pages, loaded back from the host
    assert h.runner.tokens_computed == len(follow) - 256 + 4
    h.settle()
    h.assert_idle_and_conserved()


@pytest.mark.parametrize("policy", ["best_effort", "wait_complete", "timeout"])
def test_prefetch_policies(tmp_path, policy):
    prompt = _prompt(256, 3)
    _store(tmp_path, prompt)
    h = _harness(tmp_path, storage=_storage(tmp_path, policy, timeout=0.05))
    gated = _gate(h)
    rid = h.submit(prompt + [1, 2, 3], max_new_tokens=3)
    h.step()
    assert gated.reading.wait(60)
    if policy == "best_effort":
        while h.where(rid) == "waiting":
            h.step()  # admitted without the pages
    elif policy == "wait_complete":
        for _ in range(5):
            h.step()
        assert h.where(rid) == "waiting"
    else:
        while h.where(rid) == "waiting":
            h.step()  # until the timeout admits it
        assert h.stats()["storage"]["prefetch_timeouts"] == 1
    gated.gate.set()
    h.run()
    assert h.tokens(rid) == reference_output(prompt + [1, 2, 3], 3)
    assert (h.final(rid).cached_tokens == 256) == (policy == "wait_complete")
    h.settle()
    # Whatever the policy, the pages reached the host tier: the next request reuses them.
    again = h.submit(prompt + [4], max_new_tokens=2)
    h.run()
    assert h.final(again).cached_tokens >= 256 and h.tokens(again) == reference_output(prompt + [4], 2)
    h.assert_idle_and_conserved()


def test_abort_while_a_prefetch_is_in_flight(tmp_path, schedule_mode):
    # sglang#31296: the request is aborted while its pages are being read. Nothing it held may
    # be freed under the read: here it holds nothing (host slots are taken when the read is
    # done), and the pages still enter the tree intact.
    prompt = _prompt(256, 4)
    _store(tmp_path, prompt)
    h = _harness(tmp_path)
    gated = _gate(h)
    host_used = h.tree.host_pool.used_size()
    rid = h.submit(prompt + [7], max_new_tokens=4)
    h.step()
    assert gated.reading.wait(60) and h.where(rid) == "waiting"
    h.scheduler.abort(AbortReq(rid=rid))
    while not any(o.finish_reason for o in h.outputs.get(rid, [])):
        h.step()
    assert h.final(rid).finish_reason["type"] == "abort"
    assert h.tree.host_pool.used_size() == host_used
    gated.gate.set()
    h.settle()  # the read lands after the abort; check() verifies every host copy's tokens
    assert h.tree.match(RadixKey(prompt)).host_hit_length == 256
    again = h.submit(prompt + [8], max_new_tokens=2)
    h.run()
    assert h.final(again).cached_tokens == 256
    h.assert_idle_and_conserved()


def test_prefetched_host_copies_have_host_backed_parents(tmp_path):
    # sglang#30106/#31902: the first 64 tokens are on the device only (their host mirror
    # dropped); the stored prompt continues them. The prefetch must give that node a host copy
    # too, not hang host-only nodes under it; evicting both tiers keeps it so.
    prompt = _prompt(320, 5)
    _store(tmp_path, prompt)
    h = _harness(tmp_path, write_policy="write_through_selective")
    head = h.submit(prompt[:64], max_new_tokens=1)
    h.run()
    h.settle()
    h.tree.evict_host(h.tree.host_pool.capacity)
    h.check()
    assert h.tree.host_pool.used_size() == 0 and h.tree.match(RadixKey(prompt[:64])).device_indices.numel() >= 63
    rid = h.submit(prompt + [3], max_new_tokens=2)
    h.run()  # check_integrity after every step: under this policy the host set is prefix-closed
    assert h.final(rid).cached_tokens >= 320 - 1
    assert h.tokens(head) == reference_output(prompt[:64], 1)
    for _ in range(3):
        h.cache.evict(h.cache.capacity)
        h.check()
        h.tree.evict_host(100)
        h.check()
    h.assert_idle_and_conserved()


def test_unwritable_directory_degrades_to_recomputation(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    h = _harness(blocker / "kv")  # every write fails (even as root)
    prompt = _prompt(300, 6)
    rid = h.submit(prompt, max_new_tokens=3)
    h.run()
    h.settle()
    assert h.tokens(rid) == reference_output(prompt, 3)
    s = h.stats()["storage"]
    assert s["backend_errors"] == 4 and s["backup_pages_written"] == 0
    again = h.submit(prompt + [1], max_new_tokens=2)  # the prefetch query fails quietly too
    h.run()
    assert h.tokens(again) == reference_output(prompt + [1], 2)
    h.assert_idle_and_conserved()


def test_corrupt_page_is_refused_deleted_and_recomputed(tmp_path):
    prompt = _prompt(256, 7)
    _store(tmp_path, prompt)
    keys = _harness(tmp_path).tree.storage.keys_for(RadixKey(prompt))
    path = FileStorage(str(tmp_path))._path(keys[2])
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    h = _harness(tmp_path)
    rid = h.submit(prompt + [2], max_new_tokens=3)
    h.run()
    assert h.tokens(rid) == reference_output(prompt + [2], 3)
    s = h.stats()["storage"]
    assert s["corrupt_pages"] == 1 and s["prefetched_pages"] == 2
    assert h.final(rid).cached_tokens == 128  # the pages before the corrupt one
    h.settle()
    # Deleted, then stored again from the recomputed host copy (the other pages were intact).
    assert h.stats()["storage"]["backup_pages_written"] == 1
    with open(path, "rb") as f:
        assert decode_page(keys[2], f.read(), [h.runner.kv[:1]], PAGE)[0].tolist() == prompt[128:192]
    h.assert_idle_and_conserved()


def test_a_blocked_backend_never_blocks_the_step_loop(tmp_path):
    # Every backend call blocks until the end of the test: under best_effort and timeout
    # requests run (the scheduler never calls the backend itself), and nothing leaks.
    prompt = _prompt(256, 8)
    _store(tmp_path, prompt)
    for policy in ("best_effort", "timeout"):
        h = _harness(tmp_path, storage=_storage(tmp_path, policy, timeout=0.01))
        gated = _gate(h)
        rids = [h.submit(prompt + [i], max_new_tokens=3) for i in range(3)]
        while any(not any(o.finish_reason for o in h.outputs.get(r, [])) for r in rids):
            h.step()
        for i, r in enumerate(rids):
            assert h.tokens(r) == reference_output(prompt + [i], 3)
        assert h.tree.storage.in_flight()
        gated.gate.set()
        h.settle()
        h.assert_idle_and_conserved()


def test_requests_sharing_a_stored_prefix_share_one_read(tmp_path):
    prompt = _prompt(256, 9)
    _store(tmp_path, prompt)
    h = _harness(tmp_path)
    gated = _gate(h)
    rids = [h.submit(prompt + [i], max_new_tokens=2) for i in range(3)]
    h.step()
    assert gated.reading.wait(60)
    gated.gate.set()
    h.run()
    for i, r in enumerate(rids):
        assert h.tokens(r) == reference_output(prompt + [i], 2) and h.final(r).cached_tokens == 256
    s = h.stats()["storage"]
    assert s["prefetch_ops"] == 1 and s["prefetched_pages"] == 4 and s["storage_hit_tokens"] == 256
    h.assert_idle_and_conserved()


@pytest.mark.parametrize("kw, message", [
    ({"hicache_storage_backend": "file", "hicache_storage_dir": "d"}, "needs enable_hierarchical_cache"),
    ({"enable_hierarchical_cache": True, "hicache_storage_backend": "file"}, "needs hicache_storage_dir"),
    ({"enable_hierarchical_cache": True, "hicache_storage_backend": "mooncake"}, "master's host:port"),
    ({"enable_hierarchical_cache": True, "hicache_storage_backend": "mooncake",
      "hicache_storage_backend_extra_config": "{"}, "is not JSON"),
    ({"enable_hierarchical_cache": True, "hicache_storage_backend": "file", "hicache_storage_dir": "d",
      "tp_size": 2}, "tp_size 1"),
])
def test_storage_flags_are_checked(kw, message, monkeypatch):
    from radixlm.config import ServerArgs

    monkeypatch.delenv("MOONCAKE_MASTER", raising=False)
    with pytest.raises(ValueError, match=message):
        ServerArgs.from_kwargs(**kw)


def test_a_page_corrupted_under_a_running_scheduler_is_stored_again(tmp_path):
    prompt = _prompt(256, 10)
    h = _store(tmp_path, prompt)
    key = h.tree.storage.keys_for(RadixKey(prompt))[1]
    path = FileStorage(str(tmp_path))._path(key)
    with open(path, "r+b") as f:
        f.write(b"garbage!")
    h.cache.evict(h.cache.capacity)
    h.tree.evict_host(h.tree.host_pool.capacity)  # nothing left but storage
    h.check()
    rid = h.submit(prompt + [4], max_new_tokens=2)
    h.run()
    h.settle()
    assert h.tokens(rid) == reference_output(prompt + [4], 2) and h.final(rid).cached_tokens == 64
    s = h.stats()["storage"]
    assert s["corrupt_pages"] == 1 and s["backup_pages_written"] == 4 + 1
    with open(path, "rb") as f:
        assert decode_page(key, f.read(), [h.runner.kv[:1]], PAGE)[0].tolist() == prompt[64:128]
    h.assert_idle_and_conserved()
