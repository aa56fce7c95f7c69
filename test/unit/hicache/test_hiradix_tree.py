"""HiRadixCache on its own: write policies, copy locks, eviction to host, load-back, host
eviction and exhaustion, with a fake KV (token ids) in both pools and integrity after each op."""
from __future__ import annotations

import threading

import pytest
import torch

from radixlm.hicache import CacheController, HiRadixCache, HostKVPool
from radixlm.radix_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
from radixlm.radix_cache.prefix_cache import RadixKey
from radixlm.scheduler.cache_manager import CacheManager


class Tree:
    def __init__(self, capacity: int = 64, host_capacity: int = 128, policy: str = "write_through",
                 hook=None, threshold: int = 10) -> None:
        self.kv = torch.full((capacity + 1,), -1, dtype=torch.int64)
        self.alloc = TokenToKVPoolAllocator(capacity)
        self.host = HostKVPool([self.kv], host_capacity, min_free_bytes=0)
        self.ctrl = CacheController([self.kv], self.host, copy_hook=hook)
        self.tree = HiRadixCache(host_pool=self.host, controller=self.ctrl, write_policy=policy,
                                 load_back_threshold=threshold)
        # the owner of the device slots: frees what the tree evicts, hands out load-back slots
        self.cache = CacheManager(self.tree, ReqToTokenPool(4, 256), self.alloc)

    def evict(self, n: int) -> int:
        return self.cache.evict(n)

    def load_back(self, node, mem_quota=None):
        return self.tree.tier.load_back(node, self.cache.alloc_tokens, mem_quota)

    def put(self, tokens: list[int], check: bool = True) -> None:
        """What a finished request does: compute KV, insert, free the duplicate part."""
        slots = self.alloc.alloc(len(tokens))
        if slots is None:
            self.evict(len(tokens) - self.alloc.available_size())
            slots = self.alloc.alloc(len(tokens))
        assert slots is not None
        self.kv[slots] = torch.tensor(tokens)
        present = self.tree.insert(RadixKey(tokens), slots)
        self.alloc.free(slots[:present])
        if check:
            self.check()

    def node(self, tokens: list[int]):
        return self.tree.match(RadixKey(tokens))

    def check(self) -> None:
        self.cache.check_integrity([])
        for n in self.tree.iter_nodes():
            if n is self.tree.root:
                continue
            if n.value is not None and not self.tree.device_pending(n):
                assert self.kv[n.value].tolist() == n.key.token_ids
            if n.host_value is not None and not self.tree.host_pending(n):
                assert self.host.buffers[0][n.host_value].tolist() == n.key.token_ids

    def settle(self) -> None:
        self.tree.drain()
        self.check()


A = list(range(100, 120))
B = list(range(200, 220))
C = list(range(300, 320))
D = list(range(400, 420))


def test_write_through_locks_node_until_ack_then_evicts_to_host():
    gate = threading.Event()
    t = Tree(hook=lambda kind: gate.wait(5))
    t.put(A)
    node = t.node(A).last_node
    assert node.host_value is not None and t.tree.host_pending(node)
    assert node.lock_ref == 1 and t.tree.evictable_size() == 0  # the write pins it
    assert t.tree.copy_pinned_size() == 20
    t.tree.check_events()  # starts the write, which is held: no ack yet
    assert node.lock_ref == 1
    t.check()
    gate.set()
    t.settle()
    assert node.lock_ref == 0 and not t.tree.host_pending(node)
    assert t.evict(20) == 20
    t.check()
    assert node.value is None and node.host_value is not None  # host only, still in the tree
    m = t.node(A)
    assert m.device_indices.numel() == 0 and m.host_hit_length == 20 and m.last_host_node is node
    t.kv.fill_(-1)  # the device copy is gone for good
    slots = t.load_back(m.last_host_node)
    assert slots is not None and node.lock_ref == 1  # locked until the load ack
    t.check()
    t.settle()
    assert node.lock_ref == 0 and t.kv[slots].tolist() == A
    assert t.tree.stats["loaded_back_tokens_total"] == 20


def test_write_through_selective_waits_for_a_second_use():
    t = Tree(policy="write_through_selective")
    t.put(A)
    assert t.node(A).last_node.host_value is None
    t.put(A)  # the match above was a hit: this insert is the second use
    assert t.node(A).last_node.host_value is not None
    t.settle()
    t.put(B)
    t.evict(64)  # B was never backed up: deleted; A stays host-only
    t.check()
    assert t.node(B).host_hit_length == 0 and t.node(A).host_hit_length == 20


def test_write_back_copies_at_eviction_and_waits():
    t = Tree(policy="write_back")
    t.put(A)
    node = t.node(A).last_node
    assert node.host_value is None and node.lock_ref == 0  # nothing written on insert
    assert t.evict(20) == 20
    t.check()  # the host copy is complete before the device slots were freed
    assert node.value is None and t.host.buffers[0][node.host_value].tolist() == A
    assert t.tree.stats["write_back_tokens_total"] == 20


def test_write_back_parent_of_host_only_child_is_copied_not_orphaned():
    t = Tree(policy="write_back")
    t.put(A + B)
    t.put(A + C)  # A is now a parent of two children
    t.evict(20)  # one child (LRU: B) goes to the host
    t.evict(40)  # then C and A; A must be copied or its host-only child would be orphaned
    t.check()
    m = t.node(A + B)
    assert m.host_hit_length == 40


def test_insert_revives_host_only_nodes_with_the_callers_slots():
    t = Tree()
    t.put(A)
    t.settle()
    t.evict(20)
    t.put(A + B)  # a request recomputed A: the tree takes its slots for A (not freed twice)
    t.settle()
    m = t.node(A + B)
    assert m.device_indices.numel() == 40 and m.host_hit_length == 0


def test_pretty_print_shows_the_tier_of_each_node(capsys):
    t = Tree()
    t.put(A)
    t.settle()
    t.evict(20)  # A only on the host now
    t.put(C)
    text = t.tree.pretty_print()
    assert text.startswith("HiRadixCache(policy=write_through")
    assert "[-H] (20) 100 101" in text and "[D" in text.split("(20) 300")[0].splitlines()[-1]
    assert "300 301" in capsys.readouterr().out


def test_load_back_threshold_quota_and_all_or_nothing():
    t = Tree(capacity=32)
    short = list(range(500, 509))  # 9 tokens
    t.put(short)
    t.put(A)
    t.settle()
    t.evict(64)
    assert t.load_back(t.node(short).last_host_node) is None  # under 10 tokens
    assert t.tree.stats["load_back_skipped"] == 1
    assert t.load_back(t.node(A).last_host_node, mem_quota=19) is None  # over the quota
    # no device room at all: every slot held by "requests" -> nothing is loaded, nothing changes
    held = t.alloc.alloc(t.alloc.available_size())
    assert t.load_back(t.node(A).last_host_node) is None
    assert t.tree.stats["load_back_failures"] == 1
    t.alloc.free(held)
    t.check()  # and nothing half-loaded was left behind
    assert t.load_back(t.node(A).last_host_node) is not None
    t.settle()


def test_load_back_evicts_device_to_make_room():
    t = Tree(capacity=40)
    t.put(A)
    t.settle()
    t.evict(20)
    t.put(B)
    t.put(C)  # the device is full of B and C
    t.settle()
    assert t.alloc.available_size() == 0
    slots = t.load_back(t.node(A).last_host_node)
    assert slots is not None and t.tree.stats["loaded_back_tokens_total"] == 20
    t.settle()
    assert t.node(B).host_hit_length == 20  # B (LRU) went to the host to make room


def test_load_back_of_a_deep_path_and_partial_match_split():
    t = Tree(capacity=64)
    t.put(A + B)
    t.settle()
    t.evict(64)
    m = t.node(A + B[:5])  # ends inside the host-only node: it is split
    assert m.host_hit_length == 25
    slots = t.load_back(m.last_host_node)
    assert slots is not None and slots.numel() == 25
    t.settle()
    assert t.kv[slots].tolist() == A + B[:5]
    assert t.node(A + B).host_hit_length == 15


def test_split_of_a_node_whose_write_is_in_flight():
    gate = threading.Event()
    t = Tree(hook=lambda kind: gate.wait(5))
    t.put(A)
    t.tree.check_events()
    m = t.node(A[:10])  # splits the node being written
    upper = m.last_node
    assert t.tree.host_pending(upper) and upper.lock_ref == 1
    t.check()
    gate.set()
    t.settle()
    assert upper.lock_ref == 0 and not t.tree.host_pending(upper)


def test_host_exhaustion_evicts_host_only_then_drops_mirrors():
    t = Tree(capacity=64, host_capacity=30)
    t.put(A)
    t.settle()
    t.evict(20)  # A: host only
    t.put(B)  # needs 20 host slots, 10 free: A (host only, unreferenced) is dropped
    t.settle()
    assert t.node(A).host_hit_length == 0 and t.tree.stats["host_evicted_tokens_total"] == 20
    t.put(C)  # host holds only B's mirror; B is still on the device: drop the mirror (#33862)
    t.settle()
    assert t.tree.stats["mirror_dropped_tokens_total"] == 20
    assert t.node(C).last_node.host_value is not None and t.node(B).last_node.host_value is None
    # everything on the host pinned by a lock: the backup fails, nothing breaks
    t.tree.lock(t.node(C).last_node)  # (a holder the integrity check cannot see)
    t.put(D, check=False)
    assert t.tree.stats["backup_failures"] == 1 and t.node(D).last_node.host_value is None
    t.tree.unlock(t.node(C).last_node)
    t.settle()


def test_acks_in_order_and_writes_batched_per_iteration():
    gate = threading.Event()
    seen: list[str] = []

    def hook(kind: str) -> None:
        seen.append(kind)
        gate.wait(5)
    t = Tree(hook=hook)
    t.put(A)
    t.put(B)
    t.put(C)
    assert t.ctrl.stats["write_ops"] == 0  # queued, not started
    t.tree.check_events()
    assert t.ctrl.poll_writes() == []
    gate.set()
    t.settle()
    assert t.ctrl.stats["write_ops"] == 1 and seen == ["write"]  # one copy for three nodes
    assert t.tree.protected_size() == 0


def test_reset_waits_for_copies_and_clears_the_host_pool():
    t = Tree()
    t.put(A)
    t.tree.check_events()
    t.tree.reset()
    t.alloc.clear()
    assert t.host.used_size() == 0
    t.check()


def test_integrity_catches_a_leaked_host_slot_and_a_lost_host_copy():
    t = Tree()
    t.put(A)
    t.settle()
    leaked = t.host.alloc(1)
    with pytest.raises(AssertionError, match="host pool"):
        t.check()
    t.host.free(leaked)
    t.check()
    t.evict(20)
    node = t.node(A).last_host_node
    saved, node.host_value = node.host_value, None
    with pytest.raises(AssertionError, match="without a host copy"):
        t.tree.check_integrity([])
    node.host_value = saved
    t.check()


def test_host_pool_sizing_and_ram_guard():
    from radixlm.hicache.host_pool import host_pool_size
    kv = [torch.empty((101, 2, 8), dtype=torch.float32)] * 4
    assert host_pool_size(100, kv, ratio=2.0).capacity == 200
    per_token = 4 * 2 * 8 * 4
    assert host_pool_size(100, kv, size_gb=per_token * 1000 / 1e9).capacity == 1000
    assert host_pool_size(100, kv, ratio=2.5, page_size=16).capacity == 240
    with pytest.raises(ValueError, match="hicache"):
        HostKVPool(kv, 10, min_free_bytes=1 << 62)


def test_server_args_fields_and_cli():
    import argparse

    from radixlm.config import ServerArgs
    p = argparse.ArgumentParser()
    ServerArgs.add_cli_args(p)
    ns = p.parse_args(["--enable-hierarchical-cache", "--hicache-ratio", "3", "--hicache-write-policy",
                       "write_back", "--hicache-size", "0.5"])
    a = ServerArgs.from_cli_args(ns)
    assert a.enable_hierarchical_cache and a.hicache_ratio == 3.0 and a.hicache_size == 0.5
    assert a.hicache_write_policy == "write_back"
    with pytest.raises(ValueError):
        ServerArgs.from_kwargs(enable_hierarchical_cache=True, disable_radix_cache=True)
    with pytest.raises(ValueError):
        ServerArgs.from_kwargs(hicache_write_policy="sometimes")


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
def test_random_operations_keep_both_pools_consistent(policy):
    """Random inserts (shared prefixes), matches, load-backs, evictions of both tiers and acks,
    with slow copies so many are in flight; integrity and the fake KV after every operation."""
    import random
    import time
    rng = random.Random(policy)
    t = Tree(capacity=96, host_capacity=160, policy=policy, hook=lambda kind: time.sleep(0.0005), threshold=4)
    bases = [[rng.randrange(50) for _ in range(rng.randrange(4, 20))] for _ in range(5)]
    locked = []
    for _ in range(300):
        op = rng.random()
        seq = rng.choice(bases) + [rng.randrange(50) for _ in range(rng.randrange(0, 12))]
        if op < 0.35:
            if t.alloc.available_size() + t.tree.evictable_size() + t.tree.copy_pinned_size() >= len(seq):
                t.put(seq, check=False)
        elif op < 0.55:
            m = t.node(seq)
            if m.host_hit_length:
                t.load_back(m.last_host_node)
        elif op < 0.65:
            m = t.node(seq)  # a "request" pins what it matched for a while
            if m.last_node is not t.tree.root and len(locked) < 3:
                t.tree.lock(m.last_node)
                locked.append(m.last_node)
        elif op < 0.75 and locked:
            t.tree.unlock(locked.pop(rng.randrange(len(locked))))
        elif op < 0.85:
            t.evict(rng.randrange(1, 40))
        elif op < 0.9:
            t.tree.evict_host(rng.randrange(1, 40))
        else:
            t.tree.check_events()
        # (requests' locks are not visible to check_integrity: check with them dropped)
        for n in locked:
            t.tree.unlock(n)
        t.check()
        for n in locked:
            t.tree.lock(n)
    for n in locked:
        t.tree.unlock(n)
    t.settle()
    assert t.tree.protected_size() == 0
