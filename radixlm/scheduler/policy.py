"""Orderings of the waiting queue (semantics §8)."""
from __future__ import annotations

import random
from collections import defaultdict
from typing import TYPE_CHECKING

from radixlm.core import Req
from radixlm.registry import Registry

if TYPE_CHECKING:
    from radixlm.radix_cache.prefix_cache import TreeNode
    from radixlm.scheduler.cache_manager import CacheManager

# A cache-aware sort walks the tree for every waiting request; past this many it costs more
# than it saves, so lpm and dfs-weight fall back to arrival order.
LPM_FALLBACK_QUEUE_LEN = 128

SCHEDULE_POLICIES: Registry[type[SchedulePolicy]] = Registry("schedule policy")


class SchedulePolicy:
    cache_aware = False

    def __init__(self, cache_manager: CacheManager, seed: int = 0) -> None:
        self.cache = cache_manager

    def order(self, waiting: list[Req]) -> list[Req]:
        return list(waiting)


def arrival_order(waiting: list[Req]) -> list[Req]:
    # Priority first when requests carry one (higher first), then arrival order.
    return sorted(waiting, key=lambda r: (-r.priority, r.created_time))


@SCHEDULE_POLICIES.register("fcfs")
class FcfsPolicy(SchedulePolicy):
    def order(self, waiting: list[Req]) -> list[Req]:
        return arrival_order(waiting)


@SCHEDULE_POLICIES.register("lof")
class LongestOutputFirstPolicy(SchedulePolicy):
    def order(self, waiting: list[Req]) -> list[Req]:
        return sorted(waiting, key=lambda r: (-r.priority, -r.sampling_params.max_new_tokens))


@SCHEDULE_POLICIES.register("random")
class RandomPolicy(SchedulePolicy):
    def __init__(self, cache_manager: CacheManager, seed: int = 0) -> None:
        super().__init__(cache_manager, seed)
        self.rng = random.Random(seed)

    def order(self, waiting: list[Req]) -> list[Req]:
        out = list(waiting)
        self.rng.shuffle(out)
        return out


@SCHEDULE_POLICIES.register("lpm")
class LongestPrefixMatchPolicy(SchedulePolicy):
    cache_aware = True

    def order(self, waiting: list[Req]) -> list[Req]:
        if len(waiting) > LPM_FALLBACK_QUEUE_LEN or self.cache.disabled:
            return arrival_order(waiting)
        lens = {id(r): len(self.cache.match(r)) for r in waiting}
        return sorted(waiting, key=lambda r: (-lens[id(r)], r.created_time))


@SCHEDULE_POLICIES.register("dfs-weight")
class DfsWeightPolicy(SchedulePolicy):
    """Group requests by the tree node they match and visit heavier subtrees first, so
    requests sharing a prefix run together while it is resident."""
    cache_aware = True

    def order(self, waiting: list[Req]) -> list[Req]:
        if len(waiting) > LPM_FALLBACK_QUEUE_LEN or self.cache.disabled:
            return arrival_order(waiting)
        by_node: dict[TreeNode, list[Req]] = defaultdict(list)
        for r in waiting:
            by_node[self.cache.match(r).last_node].append(r)
        weight: dict[TreeNode, int] = defaultdict(int)
        children: dict[TreeNode, list[TreeNode]] = defaultdict(list)
        root = self.cache.prefix.root
        for node, reqs in list(by_node.items()):
            cur: TreeNode | None = node
            while cur is not None:
                weight[cur] += len(reqs)
                parent = cur.parent
                if parent is not None and cur not in children[parent]:
                    children[parent].append(cur)
                cur = parent
        out: list[Req] = []
        stack = [root]
        while stack:
            node = stack.pop()
            out.extend(sorted(by_node.get(node, []), key=lambda r: r.created_time))
            kids = sorted(children.get(node, []), key=lambda n: weight[n])
            stack.extend(kids)  # heaviest popped first
        return out


def make_policy(name: str, cache_manager: CacheManager, seed: int = 0) -> SchedulePolicy:
    return SCHEDULE_POLICIES.get(name)(cache_manager, seed)
