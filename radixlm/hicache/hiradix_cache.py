"""HiRadixCache: the radix tree with a host-memory tier under it (semantics §6).

A node is in one of three states:
- device only      `value` set, `host_value` None
- backed up        `value` and `host_value` set (the host copy is valid once its write is acked)
- host only        `value` None, `host_value` set: evicted from the device, kept in the tree
Both tiers are prefix-closed (a device-resident node's ancestors are device-resident; under the
write-through policies a backed-up node's ancestors are backed up), and a host-only node has only
host-only descendants.

Copies are the controller's; the tree only decides. Locks (`lock_ref`) pin device slots:
- a node whose device→host write is in flight holds a lock until the write's ack is processed
  (`check_events()`, top of every scheduler iteration), so eviction, abort and retraction can
  never free device slots the copy still reads;
- a node loaded back holds a lock until the load's ack is processed, so its fresh device slots
  are not evicted (and handed to someone else) while the copy still writes them.
Eviction short of tokens because copies pin nodes waits for those copies instead of failing.

`_evictable_leaves` here means *device* leaves: device-resident, unlocked nodes with no
device-resident child (host-only children do not count).
"""
from __future__ import annotations

import heapq
import logging
from typing import TYPE_CHECKING

import torch

from radixlm.hicache.controller import CacheController
from radixlm.hicache.host_pool import HostKVPool
from radixlm.hicache.host_tier import HostTierOps
from radixlm.radix_cache.base import PREFIX_CACHES
from radixlm.radix_cache.radix_cache import MatchResult, RadixCache, RadixKey, TreeNode

if TYPE_CHECKING:
    from radixlm.core import Req
    from radixlm.radix_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator

logger = logging.getLogger(__name__)

__all__ = ["HiRadixCache", "WRITE_POLICIES", "LOAD_BACK_THRESHOLD"]

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
# Loading fewer tokens than this costs more in bookkeeping and copy latency than recomputing.
LOAD_BACK_THRESHOLD = 10
_EMPTY = torch.empty((0,), dtype=torch.int64)


class HiRadixCache(HostTierOps, RadixCache):
    def __init__(self, req_to_token_pool: "ReqToTokenPool", allocator: "TokenToKVPoolAllocator",
                 page_size: int = 1, eviction_policy: str = "lru", *, host_pool: HostKVPool,
                 controller: CacheController, write_policy: str = "write_through",
                 load_back_threshold: int = LOAD_BACK_THRESHOLD) -> None:
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"unknown HiCache write policy {write_policy!r}; choose from {WRITE_POLICIES}")
        self.host_pool = host_pool
        self.controller = controller
        self.write_policy = write_policy
        # Uses of a node (matches + the inserting request) before it is written through.
        self.write_threshold = 2 if write_policy == "write_through_selective" else 1
        self.load_back_threshold = load_back_threshold
        self._ongoing_writes: dict[int, TreeNode] = {}  # write op id -> deepest node it locks
        self._ongoing_loads: dict[int, TreeNode] = {}  # load op id -> node it locks
        self._host_pending: dict[TreeNode, int] = {}  # node -> write op still filling its host copy
        self._device_pending: dict[TreeNode, int] = {}  # node -> load op still filling its device copy
        self._host_pinned: set[TreeNode] = set()  # host eviction must not touch these (mid-operation)
        self.stats = {"backed_up_tokens_total": 0, "backup_failures": 0, "write_back_tokens_total": 0,
                      "loaded_back_tokens_total": 0, "load_back_ops": 0, "load_back_skipped": 0,
                      "load_back_failures": 0, "host_evicted_tokens_total": 0, "mirror_dropped_tokens_total": 0,
                      "copy_waits_under_pressure": 0}
        super().__init__(req_to_token_pool, allocator, page_size, eviction_policy)

    # ------------------------------------------------------------------ basics
    def reset(self) -> None:
        # Copies in flight refer to slots of the old tree: let them land before the pools are
        # reused (flush only runs when the scheduler is idle, so this is short).
        if hasattr(self, "_ongoing_writes"):
            self.controller.wait_writes()
            self.controller.wait_loads()
            self._ongoing_writes.clear()
            self._ongoing_loads.clear()
            self._host_pending.clear()
            self._device_pending.clear()
            self._host_pinned.clear()
            self.host_pool.clear()
        super().reset()

    @staticmethod
    def _has_device_child(node: TreeNode) -> bool:
        return any(c.value is not None for c in node.children.values())

    def _maybe_device_leaf(self, node: TreeNode) -> None:
        if (node is not self.root and node.value is not None and node.lock_ref == 0
                and not self._has_device_child(node)):
            self._evictable_leaves.add(node)

    # ------------------------------------------------------------------ match / insert
    def _match(self, key: RadixKey, count_hit: bool) -> MatchResult:
        """Walk device-resident nodes, then host-only ones (device residency is prefix-closed, so
        once a node is host-only the rest of the match is too)."""
        n = self.page_align(len(key))
        tick = self._tick()
        node, pos = self.root, 0
        values: list[torch.Tensor] = []
        last_device, last_host, host_len = self.root, None, 0
        while pos < n:
            child = node.children.get(self._child_key(key, pos))
            if child is None:
                break
            m = self._match_len(child.key.token_ids, key.token_ids, pos, n)
            partial = m < len(child.key)
            if partial:
                child = self._split_node(child, m)
            child.last_access_time = tick
            child.hit_count += count_hit
            if child.value is not None:
                assert last_host is None, f"{child!r} is device-resident below a host-only node"
                values.append(child.value)
                last_device = child
            else:
                host_len += m
                last_host = child
            node, pos = child, pos + m
            if partial:
                break
        indices = torch.cat(values) if values else _EMPTY.clone()
        return MatchResult(device_indices=indices, last_node=last_device, host_hit_length=host_len,
                           last_host_node=last_host)

    def _revive(self, parent: TreeNode, node: TreeNode, slots: torch.Tensor) -> bool:
        """A host-only node on an insert path takes the caller's slots (the tree keeps them,
        so they do not count as already present)."""
        if node.value is not None:
            return False
        node.value = slots.to(torch.int64).clone()
        self._evictable_size += len(slots)
        self._evictable_leaves.discard(parent)  # it has a device child now
        self._maybe_device_leaf(node)  # its children are all host-only
        return True

    def _inserted(self, path: list[TreeNode]) -> None:
        self._write_through(path)

    def _split_node(self, child: TreeNode, split_len: int) -> TreeNode:
        """As RadixCache._split_node, for either tier; copy bookkeeping follows the upper part."""
        assert 0 < split_len < len(child.key) and child.parent is not None
        parent = child.parent
        upper = TreeNode(key=child.key[:split_len],
                         value=None if child.value is None else child.value[:split_len].clone(),
                         parent=parent, lock_ref=child.lock_ref, last_access_time=child.last_access_time,
                         creation_time=child.creation_time, hit_count=child.hit_count, priority=child.priority,
                         host_value=None if child.host_value is None else child.host_value[:split_len].clone())
        parent.children[self._child_key(child.key)] = upper
        child.key = child.key[split_len:]
        if child.value is not None:
            child.value = child.value[split_len:].clone()
        if child.host_value is not None:
            child.host_value = child.host_value[split_len:].clone()
        child.parent = upper
        upper.children[self._child_key(child.key)] = child
        # The copy that fills `child` fills `upper` too (same op, same slots).
        for pending in (self._host_pending, self._device_pending):
            if child in pending:
                pending[upper] = pending[child]
        if child in self._host_pinned:
            self._host_pinned.add(upper)
        return upper

    # ------------------------------------------------------------------ locks
    def dec_lock_ref(self, node: TreeNode | None) -> int:
        """As RadixCache.dec_lock_ref, with the device-leaf test."""
        if node is None:
            return 0
        path = self._path_to_root(node)
        for n in path:
            if n.lock_ref <= 0:
                raise RuntimeError(f"dec_lock_ref below zero on {n!r}")
        moved = 0
        for n in path:
            n.lock_ref -= 1
            if n.lock_ref == 0:
                moved += len(n.key)
                self._maybe_device_leaf(n)
        self._evictable_size += moved
        self._protected_size -= moved
        return moved

    def _extra_lock_holders(self) -> list[TreeNode]:
        return list(self._ongoing_writes.values()) + list(self._ongoing_loads.values())

    def copy_pinned_size(self) -> int:
        """Device tokens locked only by in-flight copies: `evict()` can reclaim them by waiting,
        so admission budgets count them as evictable."""
        holders = self._extra_lock_holders()
        if not holders:
            return 0
        through: dict[TreeNode, int] = {}
        for h in holders:
            for n in self._path_to_root(h):
                through[n] = through.get(n, 0) + 1
        return sum(len(n.key) for n, c in through.items() if c == n.lock_ref)

    # ------------------------------------------------------------------ events
    def check_events(self) -> None:
        """Top of every scheduler iteration: start the writes queued since the last one, then
        process the acks of finished copies in order (unlocking their nodes)."""
        self.controller.start_writing()
        self._ack_writes(self.controller.poll_writes())
        self._ack_loads(self.controller.poll_loads())

    def writing_check(self) -> None:
        self._ack_writes(self.controller.poll_writes())

    def loading_check(self) -> None:
        self._ack_loads(self.controller.poll_loads())

    def drain(self) -> None:
        """Wait for every copy and process all acks (eviction under pressure, tests, flush)."""
        self._ack_writes(self.controller.wait_writes())
        self._ack_loads(self.controller.wait_loads())

    def _ack_writes(self, op_ids: list[int]) -> None:
        self._ack(op_ids, self._ongoing_writes, self._host_pending)

    def _ack_loads(self, op_ids: list[int]) -> None:
        self._ack(op_ids, self._ongoing_loads, self._device_pending)

    def _ack(self, op_ids: list[int], ongoing: dict[int, TreeNode], pending: dict[TreeNode, int]) -> None:
        """Finished copies: unlock what each op locked and forget the nodes it was filling."""
        if not op_ids:
            return
        for op in op_ids:
            self.dec_lock_ref(ongoing.pop(op))
        done = set(op_ids)
        for node in [x for x, o in pending.items() if o in done]:
            del pending[node]

    # ------------------------------------------------------------------ device eviction
    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` device slots if possible. Backed-up victims stay in the
        tree as host-only nodes; others are deleted (write_back copies them first)."""
        if num_tokens <= 0:
            return 0
        done = self._evict_device(num_tokens)
        if done < num_tokens and (self._ongoing_writes or self._ongoing_loads):
            # In-flight copies pin nodes (e.g. a just-retracted request's KV being written
            # through): under pressure, wait for them rather than retract or fail.
            self.stats["copy_waits_under_pressure"] += 1
            self.drain()
            done += self._evict_device(num_tokens - done)
        return done

    def _evict_device(self, num_tokens: int) -> int:
        prio = self.eviction_policy.get_priority
        heap = [(prio(x), x.id, x) for x in self._evictable_leaves]
        heapq.heapify(heap)
        freed: list[torch.Tensor] = []
        evicted = 0
        while evicted < num_tokens and heap:
            # One round of victims, then (write_back) one synchronous copy for all of them.
            victims, want = [], 0
            while evicted + want < num_tokens and heap:
                _, _, x = heapq.heappop(heap)
                victims.append(x)
                want += len(x.key)
            # An unbacked victim with host-only children must be copied too, or deleting it
            # would orphan them (never happens under write-through, whose host set is closed).
            copy = [x for x in victims if x.host_value is None and (self.write_policy == "write_back" or x.children)]
            if copy:
                self._backup_now(copy, victims)
            for x in victims:
                parent = x.parent
                assert parent is not None and x.value is not None and x.lock_ref == 0
                freed.append(x.value)
                evicted += len(x.key)
                if x.host_value is not None:
                    x.value = None  # host-only from now on
                    self._evictable_size -= len(x.key)
                    self._evictable_leaves.discard(x)
                else:
                    self._delete_subtree(x)
                if parent is not self.root and parent not in self._evictable_leaves:
                    self._maybe_device_leaf(parent)
                    if parent in self._evictable_leaves:
                        heapq.heappush(heap, (prio(parent), parent.id, parent))
        if freed:
            self.allocator.free(torch.cat(freed))
        return evicted

    def _delete_subtree(self, node: TreeNode) -> None:
        """Unlink `node` and its (host-only) descendants, freeing their host copies. The caller
        frees `node.value` (device slots) if it has one."""
        parent = node.parent
        assert parent is not None and node.lock_ref == 0
        del parent.children[self._child_key(node.key)]
        if node.value is not None:
            self._evictable_size -= len(node.key)
            self._evictable_leaves.discard(node)
        stack = [node]
        host: list[torch.Tensor] = []
        while stack:
            x = stack.pop()
            assert x is node or x.value is None, f"{x!r}: device-resident below a deleted node"
            assert x not in self._host_pending and x not in self._host_pinned
            if x.host_value is not None:
                host.append(x.host_value)
            x.value = x.host_value = None
            stack.extend(x.children.values())
            x.children = {}
        if host:
            self.host_pool.free(torch.cat(host))

    # ------------------------------------------------------------------ inspection
    def host_pending(self, node: TreeNode) -> bool:
        """True while `node`'s host copy is still being written."""
        return node in self._host_pending

    def device_pending(self, node: TreeNode) -> bool:
        """True while `node`'s device copy is still being loaded."""
        return node in self._device_pending

    def hicache_stats(self) -> dict:
        c = self.controller.stats
        writes, loads = self.controller.num_pending()
        return {"write_policy": self.write_policy, "host_capacity_tokens": self.host_pool.capacity,
                "host_used_tokens": self.host_pool.used_size(), "pending_writes": writes,
                "pending_loads": loads, "load_back_seconds_total": round(c["load_seconds"], 6),
                "load_back_wait_seconds_total": round(c["fence_wait_seconds"], 6),
                "write_seconds_total": round(c["write_seconds"], 6), **self.stats}

    def _describe(self) -> str:
        return (f"HiRadixCache(policy={self.write_policy}, evictable={self._evictable_size}, "
                f"protected={self._protected_size}, host used {self.host_pool.used_size()}/"
                f"{self.host_pool.capacity})")

    def _node_tag(self, node: TreeNode) -> str:
        """Which tiers hold the node's KV: D(evice), H(ost)."""
        return "[" + ("D" if node.value is not None else "-") + ("H" if node.host_value is not None else "-") + "] "

    def check_integrity(self, live_reqs: list["Req"]) -> None:
        from radixlm.hicache.integrity import check_hiradix_cache

        check_hiradix_cache(self, live_reqs)


PREFIX_CACHES.register("hiradix")(HiRadixCache)
