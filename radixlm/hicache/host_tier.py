"""The host tier: the host KV pool, the copy controller and the write policy, as one object that
`HiRadixCache` holds and that follows the radix tree through its hooks (`TreeHooks`).

It decides everything about host copies: which nodes are backed up (write policies) and when,
which host slots are given up when the host pool is full, and how a host-only path comes back
(`load_back`, with device slots the cache manager hands it). Copies are the controller's; the
tree's shape and counters are the tree's (the tier changes them only through tree methods).

Locks (`lock_ref`) pin device slots while a copy uses them:
- a node whose device->host write is in flight holds a lock until the write's ack is processed
  (`check_events()`, top of every scheduler iteration), so eviction, abort and retraction can
  never free device slots the copy still reads;
- a node loaded back holds a lock until the load's ack, so its fresh device slots are not
  evicted (and handed to someone else) while the copy still writes them.
"""
from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch

from radixlm.hicache.controller import CacheController
from radixlm.hicache.host_pool import HostKVPool
from radixlm.radix_cache.prefix_cache import LockHolder, RadixKey, SlotAllocator, TreeNode
from radixlm.radix_cache.radix_cache import TreeHooks

if TYPE_CHECKING:
    from radixlm.radix_cache.radix_cache import RadixCache

__all__ = ["HostTier", "HiTreeNode", "WRITE_POLICIES", "LOAD_BACK_THRESHOLD"]

# The command line's --hicache-write-policy choices.
WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
# Loading fewer tokens than this costs more in bookkeeping and copy latency than recomputing.
LOAD_BACK_THRESHOLD = 10


class HiTreeNode(TreeNode):
    """A tree node that may also have a host copy: device only (`value`), backed up (both) or
    host only (`value is None`)."""

    __slots__ = ("host_value",)

    def __init__(self, key: RadixKey, value: torch.Tensor | None, **kw: Any) -> None:
        super().__init__(key, value, **kw)
        self.host_value: torch.Tensor | None = None


def hi(node: TreeNode) -> HiTreeNode:
    """The tree of a HiRadixCache builds only HiTreeNodes (node_type)."""
    return cast(HiTreeNode, node)


class HostTier(TreeHooks):
    evict_in_rounds = True  # write_back copies a whole round of eviction victims at once

    def __init__(self, tree: RadixCache, host_pool: HostKVPool, controller: CacheController,
                 write_policy: str = "write_through", load_back_threshold: int = LOAD_BACK_THRESHOLD) -> None:
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"unknown HiCache write policy {write_policy!r}; choose from {WRITE_POLICIES}")
        self.tree = tree
        self.host_pool = host_pool
        self.controller = controller
        self.write_policy = write_policy
        # Uses of a node (matches + the inserting request) before it is written through.
        self.write_threshold = 2 if write_policy == "write_through_selective" else 1
        self.load_back_threshold = load_back_threshold
        self.ongoing_writes: dict[int, HiTreeNode] = {}  # write op id -> deepest node it locks
        self.ongoing_loads: dict[int, HiTreeNode] = {}  # load op id -> node it locks
        self.host_pending: dict[HiTreeNode, int] = {}  # node -> write op still filling its host copy
        self.device_pending: dict[HiTreeNode, int] = {}  # node -> load op still filling its device copy
        self.host_pinned: set[HiTreeNode] = set()  # host eviction must not touch these (mid-operation)
        # Called with a node whose host copy (and its ancestors') just became complete: the
        # storage tier below stores it.
        self.on_host_written: Callable[[HiTreeNode], None] | None = None
        self.stats: dict[str, int] = {
            "backed_up_tokens_total": 0, "backup_failures": 0, "write_back_tokens_total": 0,
            "loaded_back_tokens_total": 0, "load_back_ops": 0, "load_back_skipped": 0, "load_back_failures": 0,
            "host_evicted_tokens_total": 0, "mirror_dropped_tokens_total": 0, "copy_waits_under_pressure": 0}

    def clear(self) -> None:
        """Let every copy land (they refer to slots of the old tree) and empty the host pool."""
        self.controller.wait_writes()
        self.controller.wait_loads()
        for d in (self.ongoing_writes, self.ongoing_loads, self.host_pending, self.device_pending):
            d.clear()
        self.host_pinned.clear()
        self.host_pool.clear()

    # ------------------------------------------------------------------ tree hooks
    def on_split(self, upper: TreeNode, lower: TreeNode, split_len: int) -> None:
        up, low = hi(upper), hi(lower)
        if low.host_value is not None:
            up.host_value = low.host_value[:split_len].clone()
            low.host_value = low.host_value[split_len:].clone()
        # The copy that fills `lower` fills `upper` too (same op, same slots).
        for pending in (self.host_pending, self.device_pending):
            if low in pending:
                pending[up] = pending[low]
        if low in self.host_pinned:
            self.host_pinned.add(up)

    def on_insert(self, path: list[TreeNode]) -> None:
        """Write through: back up the nodes of the insert path that reached the policy's
        threshold, top-down, stopping at the first that has not (the host set stays
        prefix-closed)."""
        if self.write_policy == "write_back":
            return
        todo = []
        for node in map(hi, path):
            if node.host_value is not None:
                continue
            if node.hit_count + 1 < self.write_threshold:
                break
            todo.append(node)
        if todo:
            self._backup_async(todo)

    def before_evict(self, victims: list[TreeNode]) -> None:
        """An unbacked victim is copied first under write_back, and under any policy when it has
        host-only children (deleting it would orphan them; never under write-through, whose
        host set is closed)."""
        nodes = [hi(x) for x in victims]
        copy = [x for x in nodes if x.host_value is None and (self.write_policy == "write_back" or x.children)]
        if copy:
            self._backup_now(copy, nodes)

    def keep_evicted(self, node: TreeNode) -> bool:
        return hi(node).host_value is not None  # host only from now on

    def on_delete(self, nodes: list[TreeNode]) -> None:
        host = []
        for x in map(hi, nodes):
            assert x not in self.host_pending and x not in self.host_pinned
            if x.host_value is not None:
                host.append(x.host_value)
            x.host_value = None
        if host:
            self.host_pool.free(torch.cat(host))

    def node_tag(self, node: TreeNode) -> str:
        """Which tiers hold the node's KV: D(evice), H(ost)."""
        return "[" + ("D" if node.value is not None else "-") + ("H" if hi(node).host_value is not None else "-") + "] "

    # ------------------------------------------------------------------ write (device -> host)
    def _host_alloc(self, n: int, protect: list[HiTreeNode]) -> torch.Tensor | None:
        idx = self.host_pool.alloc(n)
        if idx is None:
            self.host_pinned.update(protect)
            try:
                self.evict_host(n - self.host_pool.available_size())
            finally:
                self.host_pinned.difference_update(protect)
            idx = self.host_pool.alloc(n)
        return idx

    @staticmethod
    def _device_values(nodes: list[HiTreeNode]) -> torch.Tensor:
        vals = [x.value for x in nodes]
        assert all(v is not None for v in vals), "backing up a node without device KV"
        return torch.cat(cast("list[torch.Tensor]", vals))

    def _backup_async(self, nodes: list[HiTreeNode]) -> None:
        """Queue one write for `nodes` (a root-down run of one path) and lock the deepest until
        its ack: that pins every node of the run on the device."""
        total = sum(len(x.key) for x in nodes)
        host = self._host_alloc(total, nodes)
        if host is None:
            self.stats["backup_failures"] += 1
            return
        op = self.controller.write(self._device_values(nodes), host)
        self._assign_host(nodes, host)
        for x in nodes:
            self.host_pending[x] = op
        self.tree.lock(nodes[-1])
        self.ongoing_writes[op] = nodes[-1]
        self.stats["backed_up_tokens_total"] += total

    def _backup_now(self, nodes: list[HiTreeNode], protect: list[HiTreeNode]) -> None:
        """write_back: copy `nodes` to the host and wait (their device slots are freed next).
        Nodes that find no host room stay without a copy (and are then deleted). Making host
        room never drops the copies of `protect` (the other victims being evicted)."""
        groups = [nodes] if len(nodes) > 1 else []
        groups += [[x] for x in nodes]  # all at once, else one by one
        for group in groups:
            group = [x for x in group if x.host_value is None]
            if not group:
                continue
            total = sum(len(x.key) for x in group)
            host = self._host_alloc(total, protect)
            if host is None:
                if len(group) == 1:
                    self.stats["backup_failures"] += 1
                continue
            self.controller.write_now(self._device_values(group), host)
            self._assign_host(group, host)
            if self.on_host_written is not None:
                for x in group:
                    self.on_host_written(x)
            self.stats["backed_up_tokens_total"] += total
            self.stats["write_back_tokens_total"] += total

    @staticmethod
    def _assign_host(nodes: list[HiTreeNode], host: torch.Tensor) -> None:
        off = 0
        for x in nodes:
            x.host_value = host[off:off + len(x.key)].clone()
            off += len(x.key)

    # ------------------------------------------------------------------ host eviction
    def evict_host(self, num_tokens: int) -> int:
        """Free at least `num_tokens` host slots if possible.

        Pass 1 (as SGLang): delete host-only leaves (device-evicted, so unreferenced), LRU first.
        Pass 2 (not in SGLang; its #33862 starvation): drop the host mirror of device-resident,
        unlocked nodes with no backed-up child; the device copy stays, so nothing is lost."""
        if num_tokens <= 0:
            return 0
        tree, root = self.tree, self.tree.root
        prio = tree.eviction_policy.get_priority

        def host_leaf(x: HiTreeNode) -> bool:
            return x is not root and x.value is None and not x.children and x not in self.host_pinned

        freed = 0
        heap = [(prio(x), x.id, x) for x in map(hi, tree.iter_nodes()) if host_leaf(x)]
        heapq.heapify(heap)
        while freed < num_tokens and heap:
            x = heapq.heappop(heap)[2]
            parent = x.parent
            assert parent is not None
            freed += len(x.key)
            tree.delete_subtree(x)
            if host_leaf(hi(parent)):
                heapq.heappush(heap, (prio(parent), parent.id, hi(parent)))
        self.stats["host_evicted_tokens_total"] += freed
        if freed >= num_tokens:
            return freed

        def droppable(x: HiTreeNode) -> bool:
            return (x is not root and x.value is not None and x.host_value is not None and x.lock_ref == 0
                    and x not in self.host_pending and x not in self.host_pinned
                    and not any(hi(c).host_value is not None for c in x.children.values()))

        heap = [(prio(x), x.id, x) for x in map(hi, tree.iter_nodes()) if droppable(x)]
        heapq.heapify(heap)
        dropped = 0
        while freed < num_tokens and heap:
            x = heapq.heappop(heap)[2]
            assert x.host_value is not None
            self.host_pool.free(x.host_value)
            x.host_value = None
            freed += len(x.key)
            dropped += len(x.key)
            if x.parent is not None and droppable(hi(x.parent)):
                heapq.heappush(heap, (prio(x.parent), x.parent.id, hi(x.parent)))
        self.stats["mirror_dropped_tokens_total"] += dropped
        return freed

    # ------------------------------------------------------------------ load back (host -> device)
    def load_back(self, node: TreeNode | None, alloc: SlotAllocator,
                  mem_quota: int | None = None) -> torch.Tensor | None:
        """Bring the host-only nodes from `node` up to its first device-resident ancestor back
        to the device, all or nothing, into slots from `alloc`. Returns the new device slots
        (root-down order), or None when skipped (under the threshold, over the quota, or no
        device room)."""
        if node is None or node.value is not None:
            return None
        path: list[HiTreeNode] = []
        x = hi(node)
        while x.value is None:
            path.append(x)
            assert x.parent is not None
            x = hi(x.parent)
        anchor = x
        path.reverse()
        total = sum(len(p.key) for p in path)
        if total < self.load_back_threshold or (mem_quota is not None and total > mem_quota):
            self.stats["load_back_skipped"] += 1
            return None
        # Making room must neither evict the anchor's path on the device nor drop `path` from the host.
        self.host_pinned.update(path)
        self.tree.lock(anchor)
        try:
            dev = alloc(total)
        finally:
            self.tree.unlock(anchor)
            self.host_pinned.difference_update(path)
        if dev is None:
            self.stats["load_back_failures"] += 1
            return None
        dev = dev.to(torch.int64)
        host = [p.host_value for p in path]
        assert all(h is not None for h in host), "a host-only node without a host copy"
        self.tree.attach(list(path), dev)
        op = self.controller.load(torch.cat(cast("list[torch.Tensor]", host)), dev)
        for p in path:
            self.device_pending[p] = op
        self.tree.lock(node)  # until the load ack: nobody may evict slots still being written
        self.ongoing_loads[op] = hi(node)
        self.stats["loaded_back_tokens_total"] += total
        self.stats["load_back_ops"] += 1
        return dev

    # ------------------------------------------------------------------ acks
    def check_events(self) -> None:
        """Start the writes queued since the last call, then process the acks of finished
        copies in order (unlocking their nodes)."""
        self.controller.start_writing()
        self._written(self._ack(self.controller.poll_writes(), self.ongoing_writes, self.host_pending))
        self._ack(self.controller.poll_loads(), self.ongoing_loads, self.device_pending)

    def drain(self) -> None:
        """Wait for every copy and process all acks (eviction under pressure, tests, flush)."""
        self._written(self._ack(self.controller.wait_writes(), self.ongoing_writes, self.host_pending))
        self._ack(self.controller.wait_loads(), self.ongoing_loads, self.device_pending)

    def _written(self, nodes: list[HiTreeNode]) -> None:
        if self.on_host_written is not None:
            for x in nodes:
                if x.host_value is not None:
                    self.on_host_written(x)

    def copies_in_flight(self) -> bool:
        return bool(self.ongoing_writes or self.ongoing_loads)

    def _ack(self, op_ids: list[int], ongoing: dict[int, HiTreeNode],
             pending: dict[HiTreeNode, int]) -> list[HiTreeNode]:
        """Finished copies: unlock what each op locked and forget the nodes it was filling;
        returns the nodes the ops locked."""
        if not op_ids:
            return []
        nodes = [ongoing.pop(op) for op in op_ids]
        for node in nodes:
            self.tree.unlock(node)
        done = set(op_ids)
        for node in [x for x, o in pending.items() if o in done]:
            del pending[node]
        return nodes

    # ------------------------------------------------------------------ inspection
    def lock_holders(self) -> list[LockHolder]:
        """The tier's own locks (copies in flight), for the lock check."""
        holders: list[LockHolder] = [(f"write op {op}", n) for op, n in self.ongoing_writes.items()]
        return holders + [(f"load op {op}", n) for op, n in self.ongoing_loads.items()]

    def copy_pinned_size(self) -> int:
        """Device tokens locked only by in-flight copies: eviction can reclaim them by waiting,
        so admission budgets count them as evictable."""
        holders = [n for _, n in self.lock_holders() if n is not None]
        if not holders:
            return 0
        through: dict[TreeNode, int] = {}
        for h in holders:
            for n in self.tree.path_to_root(h):
                through[n] = through.get(n, 0) + 1
        return sum(len(n.key) for n, c in through.items() if c == n.lock_ref)

    def summary(self) -> dict[str, Any]:
        c = self.controller.stats
        writes, loads = self.controller.num_pending()
        return {"write_policy": self.write_policy, "host_capacity_tokens": self.host_pool.capacity,
                "host_used_tokens": self.host_pool.used_size(), "pending_writes": writes,
                "pending_loads": loads, "load_back_seconds_total": round(c["load_seconds"], 6),
                "load_back_wait_seconds_total": round(c["fence_wait_seconds"], 6),
                "write_seconds_total": round(c["write_seconds"], 6), **self.stats}
