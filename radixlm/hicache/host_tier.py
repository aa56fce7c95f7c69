"""The host-tier half of HiRadixCache: backing nodes up (write policies), host eviction and
load-back. A mixin so that hiradix_cache.py keeps the tree mechanics (match, insert, locks,
acks, device eviction) and this file the decisions about the host copy; it only runs as part
of `HiRadixCache`, whose attributes it uses.
"""
from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

import torch

from radixlm.radix_cache.radix_cache import TreeNode

if TYPE_CHECKING:
    from radixlm.hicache.controller import CacheController
    from radixlm.hicache.host_pool import HostKVPool

__all__ = ["HostTierOps"]


class HostTierOps:
    # Provided by HiRadixCache (and RadixCache).
    host_pool: "HostKVPool"
    controller: "CacheController"
    write_policy: str
    write_threshold: int
    load_back_threshold: int
    stats: dict
    root: TreeNode
    _host_pinned: set[TreeNode]
    _host_pending: dict[TreeNode, int]
    _device_pending: dict[TreeNode, int]
    _ongoing_writes: dict[int, TreeNode]
    _ongoing_loads: dict[int, TreeNode]

    # ------------------------------------------------------------------ write (device -> host)
    def _write_through(self, path: list[TreeNode]) -> None:
        """Back up the nodes of an insert path that reached the policy's threshold, top-down,
        stopping at the first that has not (so the host set stays prefix-closed)."""
        if self.write_policy == "write_back":
            return
        todo = []
        for node in path:
            if node.host_value is not None:
                continue
            if node.hit_count + 1 < self.write_threshold:
                break
            todo.append(node)
        if todo:
            self._backup_async(todo)

    def _host_alloc(self, n: int, protect: list[TreeNode]) -> torch.Tensor | None:
        idx = self.host_pool.alloc(n)
        if idx is None:
            self._host_pinned.update(protect)
            try:
                self.evict_host(n - self.host_pool.available_size())
            finally:
                self._host_pinned.difference_update(protect)
            idx = self.host_pool.alloc(n)
        return idx

    def _backup_async(self, nodes: list[TreeNode]) -> None:
        """Queue one write for `nodes` (a root-down run of one path) and lock the deepest until
        its ack: that pins every node of the run on the device."""
        total = sum(len(x.key) for x in nodes)
        host = self._host_alloc(total, nodes)
        if host is None:
            self.stats["backup_failures"] += 1
            return
        op = self.controller.write(torch.cat([x.value for x in nodes]), host)  # type: ignore[misc]
        self._assign_host(nodes, host)
        for x in nodes:
            self._host_pending[x] = op
        self.inc_lock_ref(nodes[-1])
        self._ongoing_writes[op] = nodes[-1]
        self.stats["backed_up_tokens_total"] += total

    def _backup_now(self, nodes: list[TreeNode], protect: list[TreeNode]) -> None:
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
            self.controller.write_now(torch.cat([x.value for x in group]), host)  # type: ignore[misc]
            self._assign_host(group, host)
            self.stats["backed_up_tokens_total"] += total
            self.stats["write_back_tokens_total"] += total

    @staticmethod
    def _assign_host(nodes: list[TreeNode], host: torch.Tensor) -> None:
        off = 0
        for x in nodes:
            x.host_value = host[off:off + len(x.key)].clone()
            off += len(x.key)


    # ------------------------------------------------------------------ host eviction
    def evict_host(self, num_tokens: int) -> int:
        """Free at least `num_tokens` host slots if possible.

        Pass 1 (as SGLang): delete host-only leaves (device-evicted, so unreferenced), LRU first.
        Pass 2 (not in SGLang; its #33862 starvation): drop the host mirror of device-resident,
        unlocked nodes with no backed-up child — the device copy stays, so nothing is lost."""
        if num_tokens <= 0:
            return 0
        prio = self.eviction_policy.get_priority
        freed = 0
        heap = [(prio(x), x.id, x) for x in self.iter_nodes()
                if x is not self.root and x.value is None and not x.children and x not in self._host_pinned]
        heapq.heapify(heap)
        while freed < num_tokens and heap:
            _, _, x = heapq.heappop(heap)
            parent = x.parent
            assert parent is not None
            freed += len(x.key)
            self._delete_subtree(x)
            if (parent is not self.root and parent.value is None and not parent.children
                    and parent not in self._host_pinned):
                heapq.heappush(heap, (prio(parent), parent.id, parent))
        self.stats["host_evicted_tokens_total"] += freed
        if freed >= num_tokens:
            return freed

        def droppable(x: TreeNode) -> bool:
            return (x is not self.root and x.value is not None and x.host_value is not None and x.lock_ref == 0
                    and x not in self._host_pending and x not in self._host_pinned
                    and not any(c.host_value is not None for c in x.children.values()))

        heap = [(prio(x), x.id, x) for x in self.iter_nodes() if droppable(x)]
        heapq.heapify(heap)
        dropped = 0
        while freed < num_tokens and heap:
            _, _, x = heapq.heappop(heap)
            self.host_pool.free(x.host_value)  # type: ignore[arg-type]
            x.host_value = None
            freed += len(x.key)
            dropped += len(x.key)
            parent = x.parent
            if parent is not None and droppable(parent):
                heapq.heappush(heap, (prio(parent), parent.id, parent))
        self.stats["mirror_dropped_tokens_total"] += dropped
        return freed

    # ------------------------------------------------------------------ load back (host -> device)
    def load_back(self, node: TreeNode | None, mem_quota: int | None = None) -> torch.Tensor | None:
        """Bring the host-only nodes from `node` up to its first device-resident ancestor back
        to the device, all or nothing. Returns their new device slots (root-down order), or
        None when skipped (under the threshold, over the quota, or no device room)."""
        if node is None or node.value is not None:
            return None
        path: list[TreeNode] = []
        x = node
        while x.value is None:
            path.append(x)
            assert x.parent is not None
            x = x.parent
        anchor = x
        path.reverse()
        total = sum(len(p.key) for p in path)
        if total < self.load_back_threshold or (mem_quota is not None and total > mem_quota):
            self.stats["load_back_skipped"] += 1
            return None
        # Making room must neither evict the anchor's path on the device nor drop `path` from the host.
        self._host_pinned.update(path)
        self.inc_lock_ref(anchor)
        try:
            dev = self.allocator.alloc(total)
            if dev is None:
                self.evict(total - self.allocator.available_size())
                dev = self.allocator.alloc(total)
        finally:
            self.dec_lock_ref(anchor)
            self._host_pinned.difference_update(path)
        if dev is None:
            self.stats["load_back_failures"] += 1
            return None
        dev = dev.to(torch.int64)
        host = torch.cat([p.host_value for p in path])  # type: ignore[misc]
        off = 0
        for p in path:
            p.value = dev[off:off + len(p.key)].clone()
            off += len(p.key)
        self._evictable_size += total
        self._evictable_leaves.discard(anchor)
        op = self.controller.load(host, dev)
        for p in path:
            self._device_pending[p] = op
        self.inc_lock_ref(node)  # until the load ack: nobody may evict slots still being written
        self._ongoing_loads[op] = node
        self.stats["loaded_back_tokens_total"] += total
        self.stats["load_back_ops"] += 1
        return dev
