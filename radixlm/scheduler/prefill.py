"""Prefill admission: which waiting requests join the next prefill batch, and how much of each.

Budgets (semantics §8): the batch's new tokens stay within `max_prefill_tokens`; one request
contributes at most `chunked_prefill_size` tokens (the rest continues as the chunked request
next round); the KV needed now plus the decode tokens reserved for running and admitted
requests must fit in free + evictable slots.

Cost-bounded chunks: a chunk's attention grows with the keys before it, so at a fixed token
count the chunks of a long prompt get slower one after another (an 8k prompt's last 1,024-token
chunk costs ~3x its first on the default model), and the decode step after each waits for it.
With `chunk_cost_keys` = K (a new token's linears cost as much as its attention to K keys), a
chunk of n tokens over p keys costs n (K + p + n / 2); the batch may spend what C =
chunked_prefill_size tokens with no prefix would, C (K + C / 2), and a chunk is cut to fit
(never below MIN_COST_BOUNDED_CHUNK tokens, so a prompt always advances). The scheduler gives
K only while other requests decode: alone, a prompt runs in full chunks.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

import torch

from radixlm.core import Req
from radixlm.scheduler.cache_manager import CacheManager
from radixlm.scheduler.sessions import SessionTable

# Reservation per request is capped so one huge max_new_tokens cannot block admission.
CLIP_MAX_NEW_TOKENS = 4096
# In-batch prefix deduplication: a request whose uncached prefix is shared by at least this
# many tokens (or by at least half of its uncached tokens) with a request already in the batch
# waits one round and then hits the cache.
IN_BATCH_PREFIX_DEDUP_MIN = 32
# Shortest chunk a cost bound may cut a prompt to (a step has fixed costs of its own).
MIN_COST_BOUNDED_CHUNK = 64


class AddStatus(enum.Enum):
    CONTINUE = "continue"
    NO_TOKEN = "no_token"  # out of KV budget
    OTHER = "other"  # out of prefill-token budget or request slots


@dataclass
class PrefillBatchPlan:
    reqs: list[Req] = field(default_factory=list)
    prefix_lens: list[int] = field(default_factory=list)
    extend_lens: list[int] = field(default_factory=list)
    out_locs: list[torch.Tensor] = field(default_factory=list)
    sample: list[bool] = field(default_factory=list)
    new_chunked_req: Req | None = None

    def add(self, req: Req, prefix: int, extend: int, loc: torch.Tensor, last_chunk: bool) -> None:
        self.reqs.append(req)
        self.prefix_lens.append(prefix)
        self.extend_lens.append(extend)
        self.out_locs.append(loc)
        self.sample.append(last_chunk)
        if not last_chunk:
            self.new_chunked_req = req


@dataclass
class ChunkCostBudget:
    """The cost bound of one prefill batch (module docstring), in token-key units."""
    keys: int  # K: a new token's linears cost its attention to this many keys
    left: float  # what the batch may still spend

    @classmethod
    def for_chunk(cls, keys: int, chunk: int) -> ChunkCostBudget:
        """What `chunk` tokens with no prefix cost: the budget of one batch."""
        budget = cls(keys, 0.0)
        budget.left = budget.of(chunk, 0)
        return budget

    def of(self, n: int, prefix: int) -> float:
        """Cost of n new tokens after `prefix` keys."""
        return n * (self.keys + prefix + n / 2)

    def most_tokens(self, prefix: int) -> int:
        """The most new tokens after `prefix` keys that `left` pays for (the root of
        n^2 / 2 + n (K + p) = left)."""
        b = self.keys + prefix
        return int(math.sqrt(b * b + 2 * max(self.left, 0.0)) - b)


def remaining_reservation(req: Req) -> int:
    sp = req.sampling_params
    return min(max(sp.max_new_tokens - len(req.output_ids), 0), CLIP_MAX_NEW_TOKENS)


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefillAdder:
    def __init__(self, cache: CacheManager, running: list[Req], new_token_ratio: float,
                 max_prefill_tokens: int, chunked_prefill_size: int | None, max_running: int,
                 page_size: int = 1, in_batch_dedup: bool = True, chunk_cost_keys: int | None = None,
                 sessions: SessionTable | None = None) -> None:
        self.cache = cache
        self.page_size = page_size
        self.rem_input = max_prefill_tokens
        self.rem_chunk = chunked_prefill_size if chunked_prefill_size and chunked_prefill_size > 0 else None
        self.cost = (ChunkCostBudget.for_chunk(chunk_cost_keys, self.rem_chunk)
                     if chunk_cost_keys is not None and self.rem_chunk is not None else None)
        self.slots_left = max_running - len(running)
        self.nothing_running = not running
        self.in_batch_dedup = in_batch_dedup
        self.sessions = sessions
        self.new_token_ratio = new_token_ratio
        self.offset = sum(self._reservation(r) for r in running)
        self.plan = PrefillBatchPlan()
        self._admitted_fills: list[list[int]] = []

    def _reservation(self, running: Req) -> int:
        ratio = 1.0 if running.sampling_params.ignore_eos else self.new_token_ratio
        return int(remaining_reservation(running) * ratio)

    def drop_running(self, req: Req) -> None:
        """A running request is being retracted (priority preemption): its decode reservation
        and its running slot are free for this batch (its KV returns through the tree)."""
        self.offset -= self._reservation(req)
        self.slots_left += 1

    def admitted(self, req: Req) -> bool:
        return any(r is req for r in self.plan.reqs)

    def out_of_room(self, status: AddStatus) -> bool:
        """Whether a request was turned away for KV or running slots (what preemption frees),
        not for the batch's prefill-token budget."""
        return status is AddStatus.NO_TOKEN or self.slots_left <= 0

    def rem_total(self) -> int:
        return self.cache.available() + self.cache.evictable() - self.offset

    def _budget_status(self) -> AddStatus:
        if self.rem_total() <= 0:
            return AddStatus.NO_TOKEN
        if self.rem_input <= 0 or (self.rem_chunk is not None and self.rem_chunk <= 0) \
                or (self.cost is not None and self.cost.left <= 0) or self.slots_left <= 0:
            return AddStatus.OTHER
        return AddStatus.CONTINUE

    def _chunk_len(self, remaining: int, prefix: int) -> int:
        if self.rem_chunk is None:
            return remaining
        limit = self.rem_chunk
        if self.cost is not None:
            limit = min(limit, self._cost_limit(self.cost, prefix))
        if remaining <= limit:
            return remaining
        return limit // self.page_size * self.page_size

    def _cost_limit(self, cost: ChunkCostBudget, prefix: int) -> int:
        """cost.most_tokens(prefix), never below MIN_COST_BOUNDED_CHUNK (page-rounded up): a
        batch's first request gets that much, so that a prompt always advances, a later one 0
        (it waits rather than run a sliver of its prompt)."""
        n = cost.most_tokens(prefix)
        floor = -(-MIN_COST_BOUNDED_CHUNK // self.page_size) * self.page_size
        if n < floor:
            n = 0 if self.plan.reqs else floor
        return n

    def _account(self, extend: int, reserve: int, prefix: int) -> None:
        self.rem_input -= extend
        if self.rem_chunk is not None:
            self.rem_chunk -= extend
        if self.cost is not None:
            self.cost.left -= self.cost.of(extend, prefix)
        self.offset += extend + reserve

    # ------------------------------------------------------------------ chunked request
    def add_chunked_req(self, req: Req) -> AddStatus:
        """Schedule the next chunk of the request in chunked prefill (it already holds a slot)."""
        remaining = req.seqlen - req.kv_committed_len
        n = self._chunk_len(remaining, req.kv_committed_len)
        budget = self.rem_total()
        if n > budget:
            n = max(budget, 0) // self.page_size * self.page_size
        if n <= 0:
            return AddStatus.NO_TOKEN
        prefix = req.kv_committed_len
        loc = self.cache.extend(req, n)
        if loc is None:
            return AddStatus.NO_TOKEN
        last = prefix + n == req.seqlen
        self.plan.add(req, prefix, n, loc, last)
        self._account(n, remaining_reservation(req) if last else 0, prefix)
        self.slots_left -= 1
        return self._budget_status()

    # ------------------------------------------------------------------ new request
    def _add_session_turn(self, req: Req, held: Req, keep: int) -> tuple[AddStatus, bool]:
        """A session's turn continuing from the KV its session holds (sessions.py): that KV
        is handed over instead of matched in the prefix cache; the budgets are add_one_req's."""
        assert self.sessions is not None
        extend = req.seqlen - keep
        reserve = remaining_reservation(req)
        first = self.nothing_running and not self.plan.reqs
        room = self.rem_total()
        if extend + (1 if first else reserve) >= room and not (first and extend < room):
            return AddStatus.NO_TOKEN, False
        n = self._chunk_len(extend, keep)
        if self.plan.reqs and n > self.rem_input:
            n = self.rem_input // self.page_size * self.page_size
        if n <= 0:
            return AddStatus.OTHER, False
        self.cache.hand_over(held, req, keep)
        self.sessions.handed_over(req)
        loc = self.cache.extend(req, n)
        if loc is None:  # the session's KV goes to the tree; the turn waits and matches it there
            self.cache.release(req, insert=True)
            return AddStatus.NO_TOKEN, False
        self._take(req, keep, n, loc, extend, reserve)
        return self._budget_status(), True

    def should_defer(self, req: Req, prefix_len: int) -> bool:
        if not self.in_batch_dedup:
            return False
        fill = req.fill_ids
        # A short prompt counts as shared when half of its uncached part is: chat prompts behind
        # one system prompt (~20 tokens of a ~40-token prompt) would otherwise each compute it
        # again in one batch, more than the round the others then wait (the sharer's prefill).
        # The last token is always computed, so an n > 1 child (all of it shared) qualifies too.
        uncached = len(fill) - prefix_len
        need = min(IN_BATCH_PREFIX_DEDUP_MIN, (uncached + 1) // 2)
        if uncached < 2:
            return False
        return any(_common_prefix_len(fill, other) - prefix_len >= need for other in self._admitted_fills)

    def add_one_req(self, req: Req) -> tuple[AddStatus, bool]:
        """Try to admit `req`. Returns (budget status, admitted)."""
        status = self._budget_status()
        if status is not AddStatus.CONTINUE:
            return status, False
        source = self.sessions.source(req) if self.sessions is not None else None
        if source is not None:
            return self._add_session_turn(req, *source)
        if not self.cache.ready(req):  # its prefix is still being read from storage
            return AddStatus.CONTINUE, False
        match = self.cache.match(req, load_quota=self.rem_total())  # HiCache: loads host hits back
        prefix = len(match)
        extend = req.seqlen - prefix
        if self.should_defer(req, prefix):
            return AddStatus.CONTINUE, False
        reserve = remaining_reservation(req)
        first = self.nothing_running and not self.plan.reqs
        # The matched prefix is counted in rem_total() while it is evictable, but admission
        # locks it: it is no room for this request (as in SGLang, measure with it locked).
        # Counting it let a request in whose later chunks then found no room, holding its KV
        # while decode ran the pool dry ("out of memory" for requests that fit).
        self.cache.lock(match.last_node)
        room = self.rem_total()
        self.cache.unlock(match.last_node)
        # The very first request may start with less than its reservation: if decode runs
        # short later, retraction handles it; otherwise it could never be admitted.
        need = extend + (1 if first else reserve)
        if need >= room and not (first and extend < room):
            return AddStatus.NO_TOKEN, False
        if self.plan.reqs and extend > self.rem_input and self.rem_chunk is None:
            return AddStatus.OTHER, False
        n = self._chunk_len(extend, prefix)
        if self.plan.reqs and n > self.rem_input:
            n = self.rem_input // self.page_size * self.page_size
        if n <= 0:
            return AddStatus.OTHER, False
        if not self.cache.admit(req, match):
            return AddStatus.OTHER, False
        loc = self.cache.extend(req, n)
        if loc is None:
            self.cache.release(req, insert=False)
            return AddStatus.NO_TOKEN, False
        self._take(req, prefix, n, loc, extend, reserve)
        self.cache.note_admission(req, match)
        return self._budget_status(), True

    def _take(self, req: Req, prefix: int, n: int, loc: torch.Tensor, extend: int, reserve: int) -> None:
        """Put `n` tokens of `req` (after its `prefix` cached ones) into the batch, at `loc`."""
        last = n == extend
        self.plan.add(req, prefix, n, loc, last)
        self._account(n, reserve if last else 0, prefix)
        self.slots_left -= 1
        self._admitted_fills.append(req.fill_ids)
