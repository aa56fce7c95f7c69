"""Invariant checks of the radix tree and of slot ownership, as code rather than comments.

The tree's own invariants (`check_tree_shape`, `check_locks`): links, keys and pages are
consistent, the incremental counters and the device-leaf set equal a recount, and every node's
lock_ref equals the number of holders locking through it. `check_slot_ownership` is the pool-level
check the cache manager runs over the free list, the tree and the live requests (and HiCache over
the host pool): every slot 1..capacity owned exactly once. Failures raise AssertionError naming
the slot, node or holder.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from radixlm.radix_cache.prefix_cache import LockHolder, TreeNode

if TYPE_CHECKING:
    from radixlm.radix_cache.radix_cache import RadixCache

__all__ = ["check_tree_shape", "check_tree_links", "check_locks", "assert_counters", "check_slot_ownership"]


def check_slot_ownership(capacity: int, owners: list[tuple[str, torch.Tensor]]) -> None:
    """Slots 1..capacity owned exactly once across `owners`; slot 0 by nobody."""
    parts = [t.to(torch.int64).flatten() for _, t in owners if t.numel()]
    allidx = torch.cat(parts) if parts else torch.empty((0,), dtype=torch.int64)
    if allidx.numel():
        lo, hi = int(allidx.min()), int(allidx.max())
        if lo < 1 or hi > capacity:
            bad = lo if lo < 1 else hi
            who = [name for name, t in owners if bool((t == bad).any())]
            raise AssertionError(f"KV slot {bad} (outside 1..{capacity}) is owned by {who}")
    counts = torch.bincount(allidx, minlength=capacity + 1)
    dup = (counts > 1).nonzero().flatten().tolist()
    if dup:
        s = dup[0]
        who = [name for name, t in owners if bool((t == s).any())]
        raise AssertionError(f"KV slot {s} owned {int(counts[s])} times, by {who} "
                             f"({len(dup)} slots have several owners)")
    leaked = (counts[1:] == 0).nonzero().flatten().add(1).tolist()
    if leaked:
        raise AssertionError(f"{len(leaked)} KV slots owned by nobody (leaked): {leaked[:8]}")


def check_tree_links(cache: RadixCache, node: TreeNode) -> None:
    """`node`'s children point back to it, are filed under their key's first page, and keep
    the namespace of their parent."""
    for ck, child in node.children.items():
        assert child.parent is node, f"{child!r}: parent link does not point to its parent {node!r}"
        assert len(child.key) > 0, f"{child!r}: empty key below {node!r}"
        assert ck == cache.child_key(child.key), (
            f"{child!r} is filed under child key {ck!r} but its key starts {cache.child_key(child.key)!r}")
        if node is not cache.root:
            assert child.key.extra_key == node.key.extra_key, (
                f"{child!r}: extra_key {child.key.extra_key!r} differs from parent's {node.key.extra_key!r}")


def check_root(cache: RadixCache) -> None:
    root = cache.root
    assert root.parent is None and len(root.key) == 0, "root must have no parent and an empty key"
    assert root.value is not None and root.value.numel() == 0, "root must hold no KV slots"
    assert root.lock_ref == 1, f"root lock_ref is {root.lock_ref}, must stay 1"


def check_index(node: TreeNode, t: torch.Tensor, what: str) -> None:
    assert t.dtype == torch.int64 and t.dim() == 1, f"{node!r}: {what} must be 1-D int64"
    assert t.numel() == len(node.key), f"{node!r}: {t.numel()} {what} slots for {len(node.key)} tokens"


def check_tree_shape(cache: RadixCache) -> None:
    """A tree whose every node holds its device KV (no lower tier)."""
    check_root(cache)
    evictable = protected = 0
    leaves: set[TreeNode] = set()
    for node in cache.iter_nodes():
        check_tree_links(cache, node)
        if node is cache.root:
            continue
        v = node.value
        assert v is not None, f"{node!r} is evicted but still in the tree"
        check_index(node, v, "device")
        assert len(node.key) % cache.page_size == 0, f"{node!r}: length not a page multiple"
        assert node.lock_ref >= 0, f"{node!r}: negative lock_ref"
        if node.lock_ref > 0:
            protected += len(node.key)
        else:
            evictable += len(node.key)
            if not node.children:
                leaves.add(node)
    assert_counters(cache, evictable, protected, leaves, "evictable-leaf set")


def assert_counters(cache: RadixCache, evictable: int, protected: int, leaves: set[TreeNode],
                    leaf_set_name: str) -> None:
    """The tree's incremental counters and evictable-leaf set equal a fresh recount."""
    assert evictable == cache.evictable_size(), (
        f"evictable_size counter {cache.evictable_size()} != recount {evictable}")
    assert protected == cache.protected_size(), (
        f"protected_size counter {cache.protected_size()} != recount {protected}")
    have = cache.evictable_leaves()
    assert leaves == have, (
        f"{leaf_set_name} out of date: missing {list(leaves - have)[:4]}, stale {list(have - leaves)[:4]}")


def check_locks(cache: RadixCache, holders: list[LockHolder]) -> None:
    """lock_ref of every node == number of holders in its subtree (which implies that locked
    nodes have locked ancestors)."""
    expected: dict[int, int] = {}
    for who, node in holders:
        if node is None or node is cache.root:
            continue
        try:
            path = cache.path_to_root(node)
        except RuntimeError as e:
            raise AssertionError(f"{who} locks {node!r}, which is not in this tree: {e}") from None
        for n in path:
            expected[n.id] = expected.get(n.id, 0) + 1
    for node in cache.iter_nodes():
        if node is cache.root:
            continue
        want = expected.get(node.id, 0)
        assert node.lock_ref == want, (
            f"{node!r}: lock_ref {node.lock_ref} but {want} holder(s) lock through it "
            f"(leaked or missing lock/unlock)")
