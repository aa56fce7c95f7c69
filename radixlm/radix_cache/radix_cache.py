"""The radix prefix tree: token ids -> KV slot indices, shared between requests.

Each edge holds a run of tokens (`key`) and the KV slots computed for them (`value`).
A node's KV is valid only as the continuation of its ancestors' tokens, so sharing is by
prefix. Nodes in use by live requests are pinned with `lock_ref`; unpinned leaves are
evicted by policy when the allocator runs short.

Counters: `evictable_size` = tokens in nodes with lock_ref == 0, `protected_size` = tokens
in nodes with lock_ref > 0. The set `_evictable_leaves` (childless, unlocked, not root) is
kept incrementally so eviction never scans the whole tree.
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator

import torch

from radixlm.radix_cache.base import PREFIX_CACHES, BasePrefixCache
from radixlm.radix_cache.eviction import EVICTION_POLICIES, EvictionPolicy

if TYPE_CHECKING:
    from radixlm.core import Req
    from radixlm.radix_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator

__all__ = ["RadixKey", "TreeNode", "MatchResult", "RadixCache"]

_EMPTY = torch.empty((0,), dtype=torch.int64)
_node_ids = itertools.count()


@dataclass(slots=True)
class RadixKey:
    """Token ids plus a namespace: keys with different `extra_key` (LoRA, cache salt,
    weight version) never share a node, even for identical tokens."""

    token_ids: list[int]
    extra_key: str | None = None

    def __post_init__(self) -> None:
        # Matching compares list slices at C speed; a tuple or tensor would never compare equal.
        if isinstance(self.token_ids, torch.Tensor):
            self.token_ids = self.token_ids.tolist()
        elif not isinstance(self.token_ids, list):
            self.token_ids = list(self.token_ids)

    def __len__(self) -> int:
        return len(self.token_ids)

    def __getitem__(self, s: slice) -> "RadixKey":
        if not isinstance(s, slice):
            raise TypeError("RadixKey supports slicing only")
        return RadixKey(self.token_ids[s], self.extra_key)


@dataclass(eq=False, slots=True)
class TreeNode:
    # eq=False: nodes are hashed by identity (they live in sets and heaps).
    key: RadixKey
    value: torch.Tensor | None  # int64 KV slot indices; None once evicted from device
    parent: "TreeNode | None" = None
    children: dict[tuple, "TreeNode"] = field(default_factory=dict)
    lock_ref: int = 0
    last_access_time: int = 0
    creation_time: int = 0
    hit_count: int = 0
    priority: int = 0
    host_value: torch.Tensor | None = None  # reserved for the host tier
    id: int = field(default_factory=lambda: next(_node_ids))

    @property
    def evicted(self) -> bool:
        return self.value is None

    def __repr__(self) -> str:
        return (f"TreeNode(id={self.id}, len={len(self.key)}, extra_key={self.key.extra_key!r}, "
                f"lock_ref={self.lock_ref})")


@dataclass
class MatchResult:
    device_indices: torch.Tensor  # int64, the KV slots of the matched prefix
    last_node: TreeNode  # deepest matched node (root when nothing matched)
    # Host tier (HiCache) fields; the device-only tree never reports host hits.
    host_hit_length: int = 0
    last_host_node: TreeNode | None = None


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    """Length of the common prefix; compares blocks with C-speed list equality first."""
    n = min(len(a), len(b))
    i, step = 0, 64
    while i + step <= n and a[i:i + step] == b[i:i + step]:
        i += step
    while i < n and a[i] == b[i]:
        i += 1
    return i


class RadixCache(BasePrefixCache):
    def __init__(
        self,
        req_to_token_pool: "ReqToTokenPool",
        allocator: "TokenToKVPoolAllocator",
        page_size: int = 1,
        eviction_policy: str = "lru",
    ) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.page_size = page_size
        self.eviction_policy_name = eviction_policy
        self.eviction_policy: EvictionPolicy = EVICTION_POLICIES.get(eviction_policy)()
        # Logical clock for access/creation times: deterministic, strictly increasing.
        self._clock = itertools.count(1)
        self.reset()

    # ------------------------------------------------------------------ basics
    def reset(self) -> None:
        """Drop the whole tree (the caller clears the pools). Nodes of the old tree become
        foreign: locking or unlocking them raises instead of corrupting the new counters."""
        self.root = TreeNode(key=RadixKey([]), value=_EMPTY, lock_ref=1,
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

    def _child_key(self, key: RadixKey, pos: int = 0) -> tuple:
        if self.page_size == 1:
            return (key.extra_key, key.token_ids[pos])
        return (key.extra_key, tuple(key.token_ids[pos:pos + self.page_size]))

    def _match_len(self, node_tokens: list[int], tokens: list[int], pos: int, end: int) -> int:
        """Tokens of `node_tokens` matching `tokens[pos:end]`, in whole pages."""
        window = tokens[pos:min(end, pos + len(node_tokens))]
        return self.page_align(_common_prefix_len(node_tokens, window))

    # ------------------------------------------------------------------ match / insert
    def match_prefix(self, key: RadixKey) -> MatchResult:
        return self._match(key, count_hit=True)

    def _match(self, key: RadixKey, count_hit: bool) -> MatchResult:
        # count_hit=False for the cache's own re-match after an insert: a request finding the
        # tokens it just inserted is not a reuse, and must not make LFU/SLRU keep them longer.
        n = self.page_align(len(key))
        tick = self._tick()
        node, pos, values = self.root, 0, []
        while pos < n:
            child = node.children.get(self._child_key(key, pos))
            if child is None:
                break
            m = self._match_len(child.key.token_ids, key.token_ids, pos, n)
            partial = m < len(child.key)
            if partial:  # the match ends inside `child`: make the boundary a node boundary
                child = self._split_node(child, m)
            child.last_access_time = tick
            child.hit_count += count_hit
            values.append(child.value)
            node, pos = child, pos + m
            if partial:
                break
        indices = torch.cat(values) if values else _EMPTY.clone()
        return MatchResult(device_indices=indices, last_node=node)

    def insert(self, key: RadixKey, value: torch.Tensor, priority: int = 0) -> int:
        """Insert the page-aligned part of `key` with its KV slots `value`; return how many
        leading tokens were already present (the caller frees its own slots for those)."""
        n = self.page_align(len(key))
        if value.numel() < n:
            raise ValueError(f"insert: {value.numel()} KV slots for {n} tokens")
        tick = self._tick()
        node, pos = self.root, 0
        present: int | None = None  # set where the first node without device KV was revived
        path: list[TreeNode] = []
        while pos < n:
            child = node.children.get(self._child_key(key, pos))
            if child is None:
                break
            m = self._match_len(child.key.token_ids, key.token_ids, pos, n)
            if m < len(child.key):
                # After the split the new node's only child continues differently from
                # key[pos+m:], so the next iteration stops (or pos reached n).
                child = self._split_node(child, m)
            child.last_access_time = tick
            child.priority = max(child.priority, priority)
            if self._revive(node, child, value[pos:pos + m]) and present is None:
                present = pos
            path.append(child)
            node, pos = child, pos + m
        if pos < n:
            leaf = TreeNode(key=key[pos:n], value=value[pos:n].to(torch.int64).clone(), parent=node,
                            last_access_time=tick, creation_time=tick, priority=priority)
            node.children[self._child_key(leaf.key)] = leaf
            self._evictable_size += n - pos
            self._evictable_leaves.discard(node)  # it has a child now
            self._evictable_leaves.add(leaf)
            path.append(leaf)
        self._inserted(path)
        return pos if present is None else present

    def _revive(self, parent: TreeNode, node: TreeNode, slots: torch.Tensor) -> bool:
        """Hook for trees whose nodes can lack device KV (HiCache's host-only nodes): give
        `node` the caller's `slots` and return True. Every node of this tree has its KV."""
        return False

    def _inserted(self, path: list[TreeNode]) -> None:
        """Hook called with the nodes an insert walked or created, root excluded."""

    def _split_node(self, child: TreeNode, split_len: int) -> TreeNode:
        """Cut `child` after `split_len` tokens; the new upper node takes its place. The lock
        count is copied because every lock through `child` also passes the new node, so
        counters and the evictable-leaf set are unchanged."""
        assert 0 < split_len < len(child.key) and child.parent is not None and child.value is not None
        parent = child.parent
        upper = TreeNode(key=child.key[:split_len], value=child.value[:split_len].clone(), parent=parent,
                         lock_ref=child.lock_ref, last_access_time=child.last_access_time,
                         creation_time=child.creation_time, hit_count=child.hit_count,
                         priority=child.priority)
        parent.children[self._child_key(child.key)] = upper
        child.key = child.key[split_len:]
        child.value = child.value[split_len:].clone()
        child.parent = upper
        upper.children[self._child_key(child.key)] = child
        return upper

    # ------------------------------------------------------------------ locks
    def _path_to_root(self, node: TreeNode) -> list[TreeNode]:
        """Nodes from `node` up to (excluding) the root; raises for a node of another tree
        (e.g. held across `reset()`, sglang#12107) or an already evicted node."""
        path = []
        while node.parent is not None:
            if node.value is None:
                raise RuntimeError(f"lock on evicted node {node!r}")
            path.append(node)
            node = node.parent
        if node is not self.root:
            raise RuntimeError("lock on a node that is not in this tree (stale after reset()?)")
        return path

    def inc_lock_ref(self, node: TreeNode | None) -> int:
        """Pin `node` and its ancestors; returns the tokens moved evictable -> protected."""
        if node is None:
            return 0
        moved = 0
        for n in self._path_to_root(node):
            if n.lock_ref == 0:
                moved += len(n.key)
                self._evictable_leaves.discard(n)
            n.lock_ref += 1
        self._evictable_size -= moved
        self._protected_size += moved
        return moved

    def dec_lock_ref(self, node: TreeNode | None) -> int:
        """Unpin; returns the tokens moved protected -> evictable."""
        if node is None:
            return 0
        path = self._path_to_root(node)
        for n in path:  # check everything before mutating anything
            if n.lock_ref <= 0:
                raise RuntimeError(f"dec_lock_ref below zero on {n!r}")
        moved = 0
        for n in path:
            n.lock_ref -= 1
            if n.lock_ref == 0:
                moved += len(n.key)
                if not n.children:
                    self._evictable_leaves.add(n)
        self._evictable_size += moved
        self._protected_size -= moved
        return moved

    # ------------------------------------------------------------------ eviction
    def evict(self, num_tokens: int) -> int:
        """Evict whole unlocked leaves by policy until `num_tokens` are freed (or nothing is
        left to evict); a parent that becomes an unlocked leaf joins the heap."""
        if num_tokens <= 0 or not self._evictable_leaves:
            return 0
        prio = self.eviction_policy.get_priority
        heap = [(prio(n), n.id, n) for n in self._evictable_leaves]
        heapq.heapify(heap)
        freed: list[torch.Tensor] = []
        evicted = 0
        while evicted < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            assert parent is not None and node.value is not None
            freed.append(node.value)
            evicted += len(node.key)
            self._delete_leaf(node)
            if parent in self._evictable_leaves:
                heapq.heappush(heap, (prio(parent), parent.id, parent))
        self.allocator.free(torch.cat(freed))
        return evicted

    def _delete_leaf(self, node: TreeNode) -> None:
        parent = node.parent
        assert parent is not None and not node.children and node.lock_ref == 0
        del parent.children[self._child_key(node.key)]
        self._evictable_size -= len(node.key)
        self._evictable_leaves.discard(node)
        node.value = None
        if parent is not self.root and parent.lock_ref == 0 and not parent.children:
            self._evictable_leaves.add(parent)

    # ------------------------------------------------------------------ requests
    def cache_unfinished_req(self, req: "Req") -> None:
        """After a prefill chunk: hand the page-aligned committed KV to the tree and move the
        request's lock down to the new last node. The unaligned tail stays the request's."""
        row = self._req_row(req)
        aligned = self.page_align(req.kv_committed_len)
        key = RadixKey(req.fill_ids[:aligned], req.extra_key)
        cpl = req.cache_protected_len
        new_prefix_len = self.insert(key, row[:aligned], priority=req.priority)
        self._check_prefix_kept(req, new_prefix_len)
        if new_prefix_len > cpl:
            # Another request inserted these tokens meanwhile: the tree keeps its slots.
            self.allocator.free(row[cpl:new_prefix_len].clone())
        match = self._match(key, count_hit=False)
        new_indices = match.device_indices
        assert len(new_indices) == aligned, (
            f"re-match after insert found {len(new_indices)} of {aligned} tokens")
        row[cpl:aligned] = new_indices[cpl:]
        # Lock the new node before unlocking the old one: the shared path never becomes
        # evictable in between (harmless either way single-threaded, but clearer).
        self.inc_lock_ref(match.last_node)
        self.dec_lock_ref(req.last_node)
        req.last_node = match.last_node
        req.cache_protected_len = aligned

    @staticmethod
    def _check_prefix_kept(req: "Req", new_prefix_len: int) -> None:
        # The locked prefix is in the tree, so insert must find at least that much; less
        # would mean the request's tree-owned slots get inserted a second time.
        if new_prefix_len < req.cache_protected_len:
            raise RuntimeError(
                f"request {req.rid!r}: insert found {new_prefix_len} tokens but "
                f"{req.cache_protected_len} are locked in the tree (lost lock or wrong fill_ids)")

    def cache_finished_req(self, req: "Req", insert: bool = True) -> None:
        """The one release path (finish, abort, retract). With `insert`, the page-aligned
        computed tokens go to the tree (evictable); everything else the request owns is freed."""
        row = self._req_row(req)
        cpl, allocated = req.cache_protected_len, req.kv_allocated_len
        if insert:
            aligned = self.page_align(req.kv_committed_len)
            key = RadixKey(req.fill_ids[:aligned], req.extra_key)
            new_prefix_len = self.insert(key, row[:aligned], priority=req.priority)
            self._check_prefix_kept(req, new_prefix_len)
            to_free = [row[cpl:new_prefix_len], row[aligned:allocated]]
        else:
            to_free = [row[cpl:allocated]]
        self.allocator.free(torch.cat(to_free).clone())
        self.dec_lock_ref(req.last_node)
        self._release_req_slot(req)

    # ------------------------------------------------------------------ inspection
    def iter_nodes(self) -> Iterator[TreeNode]:
        """Every node, root first (depth-first, iterative: trees can be deep)."""
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def path_indices(self, node: TreeNode) -> torch.Tensor:
        """KV slots from the root down to `node` (what a request locking `node` relies on)."""
        parts = [n.value for n in reversed(self._path_to_root(node))]
        return torch.cat(parts) if parts else _EMPTY.clone()

    def _describe(self) -> str:
        """The first line of pretty_print."""
        return (f"RadixCache(page_size={self.page_size}, policy={self.eviction_policy_name}, "
                f"evictable={self._evictable_size}, protected={self._protected_size})")

    def _node_tag(self, node: TreeNode) -> str:
        """Extra per-node prefix in pretty_print (the host tier shows where the KV lives)."""
        return ""

    def pretty_print(self) -> str:
        lines = [self._describe()]
        stack: list[tuple[TreeNode, int]] = [(self.root, 0)]
        while stack:
            node, depth = stack.pop()
            toks = node.key.token_ids
            shown = " ".join(map(str, toks[:8])) + (" ..." if len(toks) > 8 else "")
            ns = f"[{node.key.extra_key}] " if node.key.extra_key is not None else ""
            lines.append(f"{'  ' * depth}{self._node_tag(node)}{ns}({len(toks)}) {shown} lock={node.lock_ref} "
                         f"hits={node.hit_count} t={node.last_access_time}")
            stack.extend((c, depth + 1) for c in node.children.values())
        text = "\n".join(lines)
        print(text)
        return text

    def check_integrity(self, live_reqs: list["Req"]) -> None:
        from radixlm.radix_cache.integrity import check_radix_cache

        check_radix_cache(self, live_reqs)

    def _extra_lock_holders(self) -> list[TreeNode]:
        """Nodes locked by something other than live requests (the host tier's in-flight
        copies will override this); check_integrity counts them as lock holders."""
        return []


PREFIX_CACHES.register("radix")(RadixCache)
