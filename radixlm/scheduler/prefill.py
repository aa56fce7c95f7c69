"""Prefill admission: which waiting requests join the next prefill batch, and how much of each.

Budgets (semantics §8): the batch's new tokens stay within `max_prefill_tokens`; one request
contributes at most `chunked_prefill_size` tokens (the rest continues as the chunked request
next round); the KV needed now plus the decode tokens reserved for running and admitted
requests must fit in free + evictable slots.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from radixlm.core import Req
from radixlm.scheduler.cache_manager import CacheManager

# Reservation per request is capped so one huge max_new_tokens cannot block admission.
CLIP_MAX_NEW_TOKENS = 4096
# In-batch prefix deduplication: a request whose uncached prefix is shared by at least this
# many tokens with a request already in the batch waits one round and then hits the cache.
IN_BATCH_PREFIX_DEDUP_MIN = 32


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
                 page_size: int = 1, in_batch_dedup: bool = True) -> None:
        self.cache = cache
        self.page_size = page_size
        self.rem_input = max_prefill_tokens
        self.rem_chunk = chunked_prefill_size if chunked_prefill_size and chunked_prefill_size > 0 else None
        self.slots_left = max_running - len(running)
        self.nothing_running = not running
        self.in_batch_dedup = in_batch_dedup
        self.offset = 0
        for r in running:
            ratio = 1.0 if r.sampling_params.ignore_eos else new_token_ratio
            self.offset += int(remaining_reservation(r) * ratio)
        self.plan = PrefillBatchPlan()
        self._admitted_fills: list[list[int]] = []

    def rem_total(self) -> int:
        return self.cache.available() + self.cache.evictable() - self.offset

    def _budget_status(self) -> AddStatus:
        if self.rem_total() <= 0:
            return AddStatus.NO_TOKEN
        if self.rem_input <= 0 or (self.rem_chunk is not None and self.rem_chunk <= 0) \
                or self.slots_left <= 0:
            return AddStatus.OTHER
        return AddStatus.CONTINUE

    def _chunk_len(self, remaining: int) -> int:
        if self.rem_chunk is None or remaining <= self.rem_chunk:
            return remaining
        return self.rem_chunk // self.page_size * self.page_size

    def _account(self, extend: int, reserve: int) -> None:
        self.rem_input -= extend
        if self.rem_chunk is not None:
            self.rem_chunk -= extend
        self.offset += extend + reserve

    # ------------------------------------------------------------------ chunked request
    def add_chunked_req(self, req: Req) -> AddStatus:
        """Schedule the next chunk of the request in chunked prefill (it already holds a slot)."""
        remaining = len(req.fill_ids) - req.kv_committed_len
        n = self._chunk_len(remaining)
        budget = self.rem_total()
        if n > budget:
            n = max(budget, 0) // self.page_size * self.page_size
        if n <= 0:
            return AddStatus.NO_TOKEN
        prefix = req.kv_committed_len
        loc = self.cache.extend(req, n)
        if loc is None:
            return AddStatus.NO_TOKEN
        last = prefix + n == len(req.fill_ids)
        self.plan.add(req, prefix, n, loc, last)
        self._account(n, remaining_reservation(req) if last else 0)
        self.slots_left -= 1
        return self._budget_status()

    # ------------------------------------------------------------------ new request
    def should_defer(self, req: Req, prefix_len: int) -> bool:
        if not self.in_batch_dedup:
            return False
        fill = req.fill_ids
        # Short prompts count as shared when all of their uncached part is (n > 1 children).
        need = min(IN_BATCH_PREFIX_DEDUP_MIN, len(fill) - 1 - prefix_len)
        if need <= 0:
            return False
        return any(_common_prefix_len(fill, other) - prefix_len >= need for other in self._admitted_fills)

    def add_one_req(self, req: Req) -> tuple[AddStatus, bool]:
        """Try to admit `req`. Returns (budget status, admitted)."""
        status = self._budget_status()
        if status is not AddStatus.CONTINUE:
            return status, False
        match = self.cache.match(req, load_quota=self.rem_total())  # HiCache: loads host hits back
        prefix = len(match)
        extend = len(req.fill_ids) - prefix
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
        n = self._chunk_len(extend)
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
        last = n == extend
        self.plan.add(req, prefix, n, loc, last)
        self._account(n, reserve if last else 0)
        self.slots_left -= 1
        self._admitted_fills.append(req.fill_ids)
        self.cache.note_admission(req, match)
        return self._budget_status(), True
