"""A Scheduler over real pools, a real HiRadixCache and the fake model, with a fake KV that
also lives in the host pool.

The fake model's "KV" of a slot is the token id it was computed for (`FakeRunner.kv`, a 1-D
tensor). The host pool mirrors that buffer, so backups and load-backs move token ids, and:
- every forward asserts that the KV a request reads holds its own tokens (FakeRunner), so a
  load-back that copied the wrong slots, or too late, fails the forward;
- freshly allocated device slots are poisoned, so a prefix "reused" without its load is caught;
- after every step, every settled copy in the tree is checked: device slots and host slots of a
  node hold exactly that node's tokens.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from radixlm.config import ServerArgs
from radixlm.hicache import HiRadixCache, build_hiradix_cache
from radixlm.radix_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
from radixlm.radix_cache.prefix_cache import DeviceKV, PrefixCacheConfig
from radixlm.radix_cache.radix_cache import RadixCache
from radixlm.scheduler.cache_manager import CacheManager
from radixlm.scheduler.scheduler import Scheduler

from test.support.fake_runner import FakeRunner
from test.support.scheduler_harness import Harness

DEFAULT_OVERLAP = True
POISON = -7
_conv_ids = itertools.count()


class PoisoningAllocator(TokenToKVPoolAllocator):
    """Fresh slots read as POISON until a forward or a load writes them."""

    def __init__(self, capacity: int, kv: torch.Tensor) -> None:
        super().__init__(capacity)
        self.kv = kv

    def alloc(self, n: int) -> torch.Tensor | None:
        out = super().alloc(n)
        if out is not None and out.numel():
            self.kv[out] = POISON
        return out


def check_fake_kv(tree: HiRadixCache, device_kv: torch.Tensor, host_kv: torch.Tensor) -> None:
    """Every settled copy of every node holds the node's tokens."""
    for node in tree.iter_nodes():
        if node is tree.root:
            continue
        toks = node.key.token_ids
        if node.value is not None and not tree.device_pending(node):
            got = device_kv[node.value].tolist()
            assert got == toks, f"{node!r}: device KV {got[:8]} != tokens {toks[:8]}"
        if node.host_value is not None and not tree.host_pending(node):
            got = host_kv[node.host_value].tolist()
            assert got == toks, f"{node!r}: host KV {got[:8]} != tokens {toks[:8]}"


@dataclass
class HiHarness(Harness):
    tree: HiRadixCache | None = None

    def check(self) -> None:
        self.scheduler.check_integrity()
        if self.tree is not None:
            check_fake_kv(self.tree, self.runner.kv, self.tree.host_pool.buffers[0])

    def step(self) -> bool:
        busy = self.scheduler.step()
        self.check()
        return busy

    def run(self, max_steps: int = 100_000) -> None:
        for _ in range(max_steps):
            if not self.step():
                self.settle()  # a real loop comes back after its idle poll, acks processed
                if self.scheduler.is_idle():
                    return
        raise AssertionError("scheduler did not become idle")

    def settle(self) -> None:
        """Let every host copy land and process its ack (a real loop does this at the top of
        later iterations), and every storage backup and prefetch finish."""
        if self.tree is not None:
            self.tree.drain()
            if self.tree.storage is not None:
                self.tree.storage.wait_idle()
        self.check()

    def stats(self) -> dict:
        return self.scheduler.get_info().get("hicache", {})


def make_hi_harness(capacity: int = 256, max_running: int = 16, chunk: int | None = None,
                    hicache: bool = True, write_policy: str = "write_through", hicache_ratio: float = 2.0,
                    copy_hook=None, vocab: int = 97, context: int = 1024, page_size: int = 1,
                    features: dict | None = None, storage: dict | None = None, **args) -> HiHarness:
    """`storage`: PrefixCacheConfig's hicache_storage_* fields (a storage tier under the host
    tier), e.g. {"hicache_storage_backend": "file", "hicache_storage_dir": d}."""
    args.setdefault("disable_overlap_schedule", not DEFAULT_OVERLAP)
    args.setdefault("enable_overlap_schedule", DEFAULT_OVERLAP)
    server_args = ServerArgs(max_total_tokens=capacity, page_size=page_size, debug_check_integrity=True,
                             enable_hierarchical_cache=hicache, hicache_ratio=hicache_ratio,
                             hicache_write_policy=write_policy, **args)
    server_args.verify()
    pool = ReqToTokenPool(max_running + 2, context)
    runner = FakeRunner(capacity, pool, vocab, context)
    alloc = PoisoningAllocator(capacity, runner.kv)
    tree: HiRadixCache | None = None
    if hicache:
        config = PrefixCacheConfig("hiradix", page_size, hicache_ratio=hicache_ratio, hicache_write_policy=write_policy,
                                   **(storage or {}))
        tree = build_hiradix_cache(config, DeviceKV(capacity, [runner.kv], copy_hook=copy_hook, min_free_bytes=0))
        prefix_cache: RadixCache = tree
    else:
        prefix_cache = RadixCache(page_size)
    cache = CacheManager(prefix_cache, pool, alloc)
    h = HiHarness(None, runner, cache, tree=tree)  # type: ignore[arg-type]
    config = server_args.scheduler_config(max_running_requests=max_running, chunked_prefill_size=chunk,
                                          device="cpu")
    h.scheduler = Scheduler(config, runner, cache, send_output=h.on_output, **(features or {}))
    return h


def multiturn(h: HiHarness, num_convs: int, turns: int, user_len: int, max_new: int,
              seed: int = 0) -> list[list[int]]:
    """Round-robin multi-turn chat: every turn of every conversation appends a user message
    to its history plus the previous answer. Returns all outputs, in submission order."""
    g = torch.Generator().manual_seed(seed)
    vocab = h.runner.vocab_size
    history = [[] for _ in range(num_convs)]
    outputs = []
    for _ in range(turns):
        rids = []
        for c in range(num_convs):
            history[c] = history[c] + torch.randint(0, vocab, (user_len,), generator=g).tolist()
            rids.append((c, h.submit(history[c], rid=f"c{next(_conv_ids)}", max_new_tokens=max_new,
                                     temperature=0)))
        h.run()
        for c, rid in rids:
            out = h.tokens(rid)
            outputs.append(out)
            history[c] = history[c] + out
    return outputs
