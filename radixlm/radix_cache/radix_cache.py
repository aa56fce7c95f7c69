"""The radix prefix tree: token ids -> KV slot indices, shared between requests.

Each edge holds a run of tokens (`key`) and the KV slots computed for them (`value`). A node's KV
is valid only as the continuation of its ancestors' tokens, so sharing is by prefix. Nodes in use
are pinned with `lock_ref`; unpinned leaves are evicted by policy when the caller needs room.

A node may stay in the tree without device KV (`value is None`) when a lower tier keeps a copy
(HiCache): matching stops the device prefix there, an insert through it gives it the caller's
slots, and the *device leaves* (`_evictable_leaves`: device-resident, unlocked, no
device-resident child) are what eviction picks from. Without a lower tier every node has its KV
and a device leaf is simply an unlocked leaf. What a lower tier adds goes through `TreeHooks`.

Counters: `evictable_size` = device tokens in nodes with lock_ref == 0, `protected_size` =
tokens in nodes with lock_ref > 0; both and the leaf set are kept incrementally, so eviction
never scans the whole tree.
"""
from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from typing import Any

import torch

from radixlm.radix_cache.eviction import EVICTION_POLICIES, EvictionPolicy
from radixlm.radix_cache.prefix_cache import (
    EMPTY_SLOTS,
    PREFIX_CACHES,
    DeviceKV,
    LockHolder,
    MatchResult,
    PrefixCache,
    PrefixCacheConfig,
    RadixKey,
    TreeNode,
)

__all__ = ["RadixCache", "TreeHooks"]


class TreeHooks:
    """What a lower tier (HiCache's host tier) needs to follow the tree; the defaults do nothing.
    The tree calls them at the points named; none of them may change the tree's counters."""

    # Evict victims in rounds (all the victims a request needs at once, then their parents)
    # instead of one leaf at a time, so that `before_evict` can copy a round in one go.
    evict_in_rounds = False

    def on_split(self, upper: TreeNode, lower: TreeNode, split_len: int) -> None:
        """`lower` was cut after `split_len` tokens; `upper` took its first part and its place."""

    def on_insert(self, path: list[TreeNode]) -> None:
        """An insert walked or created `path` (root excluded, root-down)."""

    def before_evict(self, victims: list[TreeNode]) -> None:
        """These device leaves are about to lose their device KV."""

    def keep_evicted(self, node: TreeNode) -> bool:
        """Whether an evicted node stays in the tree without device KV (else it is deleted)."""
        return False

    def on_delete(self, nodes: list[TreeNode]) -> None:
        """`nodes` (a subtree, root first) left the tree."""

    def node_tag(self, node: TreeNode) -> str:
        """A prefix for the node's line in pretty_print."""
        return ""


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    """Length of the common prefix; compares blocks with C-speed list equality first."""
    n = min(len(a), len(b))
    i, step = 0, 64
    while i + step <= n and a[i:i + step] == b[i:i + step]:
        i += step
    while i < n and a[i] == b[i]:
        i += 1
    return i


class RadixCache(PrefixCache):
    def __init__(self, page_size: int = 1, eviction_policy: str = "lru", *, hooks: TreeHooks | None = None,
                 node_type: type[TreeNode] = TreeNode) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.eviction_policy_name = eviction_policy
        self.eviction_policy: EvictionPolicy = EVICTION_POLICIES.get(eviction_policy)()
        self.hooks = hooks or TreeHooks()
        self.node_type = node_type
        # Logical clock for access/creation times: deterministic, strictly increasing.
        self._clock = itertools.count(1)
        self.reset()

    # ------------------------------------------------------------------ basics
    def reset(self) -> None:
        """Drop the whole tree. Nodes of the old tree become foreign: locking or unlocking them
        raises instead of corrupting the new counters."""
        self.root = self.node_type(key=RadixKey([]), value=EMPTY_SLOTS, lock_ref=1,
                                   last_access_time=self._tick(), creation_time=0)
        self._evictable_size = 0
        self._protected_size = 0
        self._evictable_leaves: set[TreeNode] = set()

    def _tick(self) -> int:
        return next(self._clock)

    def evictable_size(self) -> int:
        return self._evictable_size

    def protected_size(self) -> int:
        return self._protected_size

    def evictable_leaves(self) -> set[TreeNode]:
        return self._evictable_leaves

    def child_key(self, key: RadixKey, pos: int = 0) -> Any:
        if self.page_size == 1:
            return (key.extra_key, key.token_ids[pos])
        return (key.extra_key, tuple(key.token_ids[pos:pos + self.page_size]))

    def _match_len(self, node_tokens: list[int], tokens: list[int], pos: int, end: int) -> int:
        """Tokens of `node_tokens` matching `tokens[pos:end]`, in whole pages."""
        window = tokens[pos:min(end, pos + len(node_tokens))]
        return self.page_align(_common_prefix_len(node_tokens, window))

    @staticmethod
    def _has_device_child(node: TreeNode) -> bool:
        return any(c.value is not None for c in node.children.values())

    def _maybe_device_leaf(self, node: TreeNode) -> None:
        if (node is not self.root and node.value is not None and node.lock_ref == 0
                and not self._has_device_child(node)):
            self._evictable_leaves.add(node)

    # ------------------------------------------------------------------ match / insert
    def _descend(self, node: TreeNode, key: RadixKey, pos: int, n: int) -> tuple[TreeNode, int] | None:
        """The child of `node` continuing `key[pos:n]` and how many tokens of it match (whole
        pages); a match ending inside the child splits it, so the child returned ends there and
        the next descent from it finds nothing."""
        child = node.children.get(self.child_key(key, pos))
        if child is None:
            return None
        m = self._match_len(child.key.token_ids, key.token_ids, pos, n)
        if m < len(child.key):
            child = self._split_node(child, m)
        return child, m

    def walk(self, key: RadixKey, count_hit: bool = True) -> list[TreeNode]:
        """The nodes matching `key` from the root down, touched (access time, hit count)."""
        n = self.page_align(len(key))
        tick = self._tick()
        node, pos = self.root, 0
        path: list[TreeNode] = []
        while pos < n and (step := self._descend(node, key, pos, n)) is not None:
            node, m = step
            node.last_access_time = tick
            node.hit_count += count_hit
            path.append(node)
            pos += m
        return path

    def device_match(self, path: list[TreeNode]) -> MatchResult:
        """The device-resident head of a walked path (device residency is prefix-closed)."""
        values: list[torch.Tensor] = []
        last = self.root
        for node in path:
            if node.value is None:
                break
            values.append(node.value)
            last = node
        return MatchResult(torch.cat(values) if values else EMPTY_SLOTS.clone(), last)

    def match(self, key: RadixKey, *, count_hit: bool = True) -> MatchResult:
        return self.device_match(self.walk(key, count_hit))

    def insert(self, key: RadixKey, value: torch.Tensor, priority: int = 0) -> int:
        n = self.page_align(len(key))
        if value.numel() < n:
            raise ValueError(f"insert: {value.numel()} KV slots for {n} tokens")
        tick = self._tick()
        node, pos = self.root, 0
        present: int | None = None  # set where the first node without device KV took slots
        path: list[TreeNode] = []
        while pos < n and (step := self._descend(node, key, pos, n)) is not None:
            node, m = step
            node.last_access_time = tick
            node.priority = max(node.priority, priority)
            if node.value is None:  # kept for a lower tier: it takes the caller's slots
                self.attach([node], value[pos:pos + m])
                if present is None:
                    present = pos
            path.append(node)
            pos += m
        if pos < n:
            leaf = self.node_type(key=key[pos:n], value=value[pos:n].to(torch.int64).clone(), parent=node,
                                  last_access_time=tick, creation_time=tick, priority=priority)
            node.children[self.child_key(leaf.key)] = leaf
            self._evictable_size += n - pos
            self._evictable_leaves.discard(node)  # it has a child now
            self._evictable_leaves.add(leaf)
            path.append(leaf)
        self.hooks.on_insert(path)
        return pos if present is None else present

    def attach(self, path: list[TreeNode], slots: torch.Tensor) -> None:
        """Give the device-less nodes of `path` (root-down, below a device-resident node) the
        device slots `slots`, in order; they become evictable."""
        assert path and path[0].parent is not None
        off = 0
        for p in path:
            assert p.value is None, f"{p!r} already holds device KV"
            p.value = slots[off:off + len(p.key)].to(torch.int64).clone()
            off += len(p.key)
        self._evictable_size += off
        self._evictable_leaves.discard(path[0].parent)  # it has a device child now
        self._maybe_device_leaf(path[-1])

    def _split_node(self, child: TreeNode, split_len: int) -> TreeNode:
        """Cut `child` after `split_len` tokens; the new upper node takes its place. The lock
        count is copied because every lock through `child` also passes the new node, so
        counters and the leaf set are unchanged."""
        assert 0 < split_len < len(child.key) and child.parent is not None
        parent = child.parent
        upper = self.node_type(key=child.key[:split_len],
                               value=None if child.value is None else child.value[:split_len].clone(),
                               parent=parent, lock_ref=child.lock_ref, last_access_time=child.last_access_time,
                               creation_time=child.creation_time, hit_count=child.hit_count,
                               priority=child.priority)
        parent.children[self.child_key(child.key)] = upper
        child.key = child.key[split_len:]
        if child.value is not None:
            child.value = child.value[split_len:].clone()
        child.parent = upper
        upper.children[self.child_key(child.key)] = child
        self.hooks.on_split(upper, child, split_len)
        return upper

    # ------------------------------------------------------------------ locks
    def path_to_root(self, node: TreeNode) -> list[TreeNode]:
        """Nodes from `node` up to (excluding) the root; raises for a node of another tree
        (e.g. held across `reset()`, sglang#12107) or one without device KV."""
        path = []
        while node.parent is not None:
            if node.value is None:
                raise RuntimeError(f"lock on evicted node {node!r}")
            path.append(node)
            node = node.parent
        if node is not self.root:
            raise RuntimeError("lock on a node that is not in this tree (stale after reset()?)")
        return path

    def lock(self, node: TreeNode | None) -> int:
        if node is None:
            return 0
        moved = 0
        for n in self.path_to_root(node):
            if n.lock_ref == 0:
                moved += len(n.key)
                self._evictable_leaves.discard(n)
            n.lock_ref += 1
        self._evictable_size -= moved
        self._protected_size += moved
        return moved

    def unlock(self, node: TreeNode | None) -> int:
        if node is None:
            return 0
        path = self.path_to_root(node)
        for n in path:  # check everything before mutating anything
            if n.lock_ref <= 0:
                raise RuntimeError(f"unlock below zero on {n!r}")
        moved = 0
        for n in path:
            n.lock_ref -= 1
            if n.lock_ref == 0:
                moved += len(n.key)
                self._maybe_device_leaf(n)
        self._evictable_size += moved
        self._protected_size -= moved
        return moved

    # ------------------------------------------------------------------ eviction
    def evict(self, num_tokens: int) -> torch.Tensor:
        """Evict whole device leaves by policy until `num_tokens` are freed (or nothing is
        left); a parent that becomes a device leaf joins the heap."""
        if num_tokens <= 0 or not self._evictable_leaves:
            return EMPTY_SLOTS.clone()
        prio = self.eviction_policy.get_priority
        heap = [(prio(n), n.id, n) for n in self._evictable_leaves]
        heapq.heapify(heap)
        freed: list[torch.Tensor] = []
        evicted = 0
        while evicted < num_tokens and heap:
            victims: list[TreeNode] = []
            want = 0
            while heap and (not victims or (self.hooks.evict_in_rounds and evicted + want < num_tokens)):
                x = heapq.heappop(heap)[2]
                victims.append(x)
                want += len(x.key)
            self.hooks.before_evict(victims)
            for x in victims:
                parent = x.parent
                assert parent is not None and x.value is not None and x.lock_ref == 0
                freed.append(x.value)
                evicted += len(x.key)
                if self.hooks.keep_evicted(x):
                    x.value = None
                    self._evictable_size -= len(x.key)
                    self._evictable_leaves.discard(x)
                else:
                    self.delete_subtree(x)
                if parent is not self.root and parent not in self._evictable_leaves:
                    self._maybe_device_leaf(parent)
                    if parent in self._evictable_leaves:
                        heapq.heappush(heap, (prio(parent), parent.id, parent))
        return torch.cat(freed)

    def delete_subtree(self, node: TreeNode) -> None:
        """Unlink unlocked `node` and its descendants (which hold no device KV). The caller
        frees `node.value` if it has one."""
        parent = node.parent
        assert parent is not None and node.lock_ref == 0
        del parent.children[self.child_key(node.key)]
        if node.value is not None:
            self._evictable_size -= len(node.key)
            self._evictable_leaves.discard(node)
        removed, stack = [], [node]
        while stack:
            x = stack.pop()
            assert x is node or x.value is None, f"{x!r}: device-resident below a deleted node"
            removed.append(x)
            stack.extend(x.children.values())
        self.hooks.on_delete(removed)
        for x in removed:
            x.value = None
            x.children = {}

    # ------------------------------------------------------------------ inspection
    def iter_nodes(self) -> Iterator[TreeNode]:
        """Every node, root first (depth-first, iterative: trees can be deep)."""
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def path_indices(self, node: TreeNode) -> torch.Tensor:
        parts = [n.value for n in reversed(self.path_to_root(node)) if n.value is not None]
        return torch.cat(parts) if parts else EMPTY_SLOTS.clone()

    def device_slots(self) -> torch.Tensor:
        vals = [n.value for n in self.iter_nodes() if n is not self.root and n.value is not None]
        return torch.cat(vals) if vals else EMPTY_SLOTS.clone()

    def describe(self) -> str:
        """The first line of pretty_print."""
        return (f"RadixCache(page_size={self.page_size}, policy={self.eviction_policy_name}, "
                f"evictable={self._evictable_size}, protected={self._protected_size})")

    def pretty_print(self) -> str:
        lines = [self.describe()]
        stack: list[tuple[TreeNode, int]] = [(self.root, 0)]
        while stack:
            node, depth = stack.pop()
            toks = node.key.token_ids
            shown = " ".join(map(str, toks[:8])) + (" ..." if len(toks) > 8 else "")
            ns = f"[{node.key.extra_key}] " if node.key.extra_key is not None else ""
            lines.append(f"{'  ' * depth}{self.hooks.node_tag(node)}{ns}({len(toks)}) {shown} "
                         f"lock={node.lock_ref} hits={node.hit_count} t={node.last_access_time}")
            stack.extend((c, depth + 1) for c in node.children.values())
        text = "\n".join(lines)
        print(text)
        return text

    def check_integrity(self, holders: list[LockHolder]) -> None:
        from radixlm.radix_cache.integrity import check_locks, check_tree_shape

        check_tree_shape(self)
        check_locks(self, holders)


@PREFIX_CACHES.register("radix")
def _build(config: PrefixCacheConfig, device: DeviceKV) -> RadixCache:
    return RadixCache(config.page_size, config.eviction_policy)
