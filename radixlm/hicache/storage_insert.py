"""Pages fetched from storage enter the tree as host copies (scheduler thread only).

The fetched data covers tokens [start, end) of a key. The key's path is walked again now (the
tree may have changed while the pages were read): nodes that already have a host copy are kept;
a node without one gets its host copy from the data when the data covers it (a device-only node
becomes backed up); the first node the data cannot cover ends the insert, since a host copy
below it would have a parent without one (sglang#30106/#31902: prefetched host nodes hung under
device-only parents, and eviction later broke the tree). Past the tree's end, a new host-only
leaf takes the rest. Host slots come from the host pool (evicting host-only leaves, never the
walked path); without room nothing is inserted.

Host slots are taken here, after the read finished: a request aborted while its pages are read
holds nothing that the read still writes (sglang#31296).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from radixlm.hicache.host_tier import HiTreeNode, hi
from radixlm.radix_cache.prefix_cache import RadixKey

if TYPE_CHECKING:
    from radixlm.hicache.hiradix_cache import HiRadixCache

__all__ = ["insert_fetched"]


def insert_fetched(cache: HiRadixCache, key: RadixKey, start: int, rows: list[torch.Tensor]) -> int:
    """Give the tree host copies of `key[start:start + len(rows[0])]`; returns how many tokens
    of host copies were added (0 when nothing could be)."""
    end = start + int(rows[0].shape[0])
    end = cache.page_align(min(end, len(key)))
    if end <= start:
        return 0
    path = [hi(n) for n in cache.walk(key[:end], count_hit=False)]
    adopt: list[tuple[HiTreeNode, int]] = []  # nodes to back up from the data, at their offset
    pos = 0
    parent: HiTreeNode = hi(cache.root)
    for node in path:
        if node.host_value is None:
            if pos < start:
                return 0  # the data does not reach this node: nothing below it may be hosted
            adopt.append((node, pos))
        pos += len(node.key)
        parent = node
    tail = end - pos
    need = sum(len(n.key) for n, _ in adopt) + tail
    if need == 0:
        return 0
    tier = cache.tier
    host = tier.host_pool.alloc(need)
    if host is None:
        tier.host_pinned.update(path)
        try:
            tier.evict_host(need - tier.host_pool.available_size())
        finally:
            tier.host_pinned.difference_update(path)
        # Host eviction deletes only host-only leaves: the pinned path is still in the tree.
        host = tier.host_pool.alloc(need)
        if host is None:
            return 0
    bufs = tier.host_pool.buffers
    off = 0

    def fill(lo: int, n: int) -> torch.Tensor:
        nonlocal off
        slots = host[off:off + n].to(torch.int64).clone()
        for buf, r in zip(bufs, rows, strict=True):
            buf[slots] = r[lo - start:lo - start + n]
        off += n
        return slots

    for node, at in adopt:
        node.host_value = fill(at, len(node.key))
    if tail:
        leaf = cache.node_type(key=key[pos:end], value=None, parent=parent)
        hi(leaf).host_value = fill(pos, tail)
        parent.children[cache.child_key(leaf.key)] = leaf
    cache.walk(key[:end], count_hit=False)  # recent for host eviction's LRU
    return need
