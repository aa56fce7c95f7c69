"""Property test: the cache manager over the radix cache, the real pools and real Req objects
driven through random admissions, chunked prefill, decode, over-allocation, finish, abort, retract and eviction.

Each computed token writes a fake KV value `kv[slot] = (extra_key, prefix up to the token)`.
Whatever the tree hands out on a match must carry exactly those values for the matched tokens,
and the matched tokens must be a prefix of something inserted under the same extra_key.
`check_integrity` runs after every step (single ownership of every slot, counters, locks).
"""
from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixlm.core import Req
from radixlm.radix_cache.eviction import EVICTION_POLICIES
from radixlm.radix_cache.prefix_cache import RadixKey
from radixlm.scheduler.cache_manager import PrefixMatch
from test.support.radix_helpers import build_cache, make_req

BASES = [[0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2], [0, 1, 1, 0, 1, 1, 0, 1, 1, 0, 1, 1], [2, 2, 2, 2, 2, 2, 2, 2]]
EXTRA_KEYS = st.sampled_from([None, None, None, "a"])  # mostly one namespace: more sharing


@st.composite
def token_seqs(draw: st.DrawFn, min_size: int = 1) -> list[int]:
    """A (possibly empty) slice of a shared base plus a random suffix: lots of partial sharing."""
    base = draw(st.sampled_from(BASES))
    cut = draw(st.one_of(st.just(len(base)), st.integers(0, len(base))))  # often the whole base
    seq = base[:cut] + draw(st.lists(st.integers(0, 3), max_size=6))
    return seq if len(seq) >= min_size else seq + [3]


class RadixCacheMachine(RuleBasedStateMachine):
    PAGE_SIZE = 1
    DISABLED = False
    CAPACITY = 28  # small: eviction and out-of-KV retraction happen often
    MAX_CTX = 24
    REQ_SLOTS = 4

    def __init__(self) -> None:
        super().__init__()
        self.live: list[Req] = []
        self.waiting: list[Req] = []  # retracted, to be re-admitted
        self.kv: dict[int, tuple | None] = {}
        self.inserted: dict[str | None, set[tuple[int, ...]]] = {}

    # ------------------------------------------------------------ helpers
    def aligned(self, n: int) -> int:
        return n // self.PAGE_SIZE * self.PAGE_SIZE

    def record_insert(self, req: Req, committed: int) -> None:
        if not self.DISABLED:
            self.inserted.setdefault(req.extra_key, set()).add(tuple(req.fill_ids[:self.aligned(committed)]))

    def check_match(self, tokens: list[int], ek: str | None, indices: list[int]) -> None:
        n = len(indices)
        assert n % self.PAGE_SIZE == 0 and n <= len(tokens)
        if n == 0:
            return
        assert any(seq[:n] == tuple(tokens[:n]) for seq in self.inserted.get(ek, ())), (
            f"matched {tokens[:n]} under {ek!r}, never inserted")
        for p, slot in enumerate(indices):
            assert self.kv.get(slot) == (ek, tuple(tokens[:p + 1])), f"slot {slot} holds wrong KV"

    def pick(self, i: int, pool: list[Req]) -> Req:
        return pool[i % len(pool)]

    def release(self, req: Req, insert: bool) -> None:
        committed = req.kv_committed_len
        self.cache.release(req, insert=insert)
        self.live.remove(req)
        if insert:
            self.record_insert(req, committed)
            if not self.DISABLED:  # nothing evicted since: the whole aligned part must match
                key = req.fill_ids[:self.aligned(committed)]
                m = self.cache.prefix.match(RadixKey(key, req.extra_key))
                assert len(m.device_indices) == len(key)
                self.check_match(key, req.extra_key, m.device_indices.tolist())

    # ------------------------------------------------------------ rules
    @initialize(policy=st.sampled_from(EVICTION_POLICIES.names()))
    def init(self, policy: str) -> None:
        self.cache = build_cache(capacity=self.CAPACITY, page_size=self.PAGE_SIZE, policy=policy,
                                 req_slots=self.REQ_SLOTS, max_context_len=self.MAX_CTX,
                                 disabled=self.DISABLED)

    def _admit(self, req: Req) -> None:
        # Match all but the last token: at least one token is computed to produce logits.
        fill = req.fill_ids
        m = self.cache.prefix.match(RadixKey(fill[:len(fill) - 1], req.extra_key))
        self.check_match(fill, req.extra_key, m.device_indices.tolist())
        assert self.cache.admit(req, PrefixMatch(m.device_indices, m.last_node))
        self.live.append(req)

    @precondition(lambda self: len(self.live) < self.REQ_SLOTS)
    @rule(prompt=token_seqs(), ek=EXTRA_KEYS, prio=st.integers(0, 3))
    def admit(self, prompt: list[int], ek: str | None, prio: int) -> None:
        self._admit(make_req(prompt, extra_key=ek, priority=prio))

    @precondition(lambda self: len(self.live) < self.REQ_SLOTS)
    @rule(prompt=token_seqs(), ek=EXTRA_KEYS, chunk=st.integers(1, 8), n_out=st.integers(0, 4),
          cache_it=st.booleans())
    def serve_whole(self, prompt: list[int], ek: str | None, chunk: int, n_out: int, cache_it: bool) -> None:
        """A whole request in one step (chunked prefill, a few decode steps, finish): fills the
        tree so that the interleaved rules meet shared prefixes."""
        req = make_req(prompt, extra_key=ek)
        self._admit(req)
        steps = 0
        while req in self.live and req.kv_committed_len < len(req.fill_ids) and steps < 20:
            decoding = req.kv_committed_len >= len(prompt)
            if decoding and len(req.output_ids) > n_out:
                break
            self.compute(self.live.index(req), 1 if decoding else chunk, 1, cache_it)
            steps += 1
        if req in self.live:
            self.release(req, insert=True)

    @precondition(lambda self: self.waiting and len(self.live) < self.REQ_SLOTS)
    @rule(i=st.integers(0, 7))
    def readmit(self, i: int) -> None:
        req = self.pick(i, self.waiting)
        self.waiting.remove(req)
        self._admit(req)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 7), k=st.integers(1, 12), tok=st.integers(0, 3), cache_it=st.booleans())
    def compute_more(self, i: int, k: int, tok: int, cache_it: bool) -> None:
        # A second rule for the same step: computing is the common case, make it twice as likely.
        self.compute(i, k, tok, cache_it)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 7), k=st.integers(1, 12), tok=st.integers(0, 3), cache_it=st.booleans())
    def compute(self, i: int, k: int, tok: int, cache_it: bool) -> None:
        """One prefill chunk or decode step of k tokens; sample when all tokens have KV."""
        req = self.pick(i, self.live)
        fill = req.fill_ids
        k = min(k, len(fill) - req.kv_committed_len)
        if k == 0:
            return
        need = req.kv_committed_len + k - req.kv_allocated_len
        if need > 0:
            slots = self.cache.extend(req, need)
            if slots is None:  # out of KV: retract this request (insert what it computed)
                self.release(req, insert=True)
                req.num_retractions += 1
                self.waiting.append(req)
                return
        row = self.cache.req_to_token_pool.req_to_token[req.req_pool_idx]
        for p in range(req.kv_committed_len, req.kv_committed_len + k):
            self.kv[int(row[p])] = (req.extra_key, tuple(fill[:p + 1]))
        self.cache.commit(req, k)
        if req.kv_committed_len == len(fill) and len(fill) < self.MAX_CTX:
            req.output_ids.append(tok)
        if cache_it:
            committed = req.kv_committed_len
            self.cache.cache_prefill(req)
            self.record_insert(req, committed)
            assert req.cache_protected_len == (0 if self.DISABLED else self.aligned(committed))

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 7))
    def over_allocate(self, i: int) -> None:
        """Reserve a slot for the next step without writing it (overlap scheduling)."""
        req = self.pick(i, self.live)
        if req.kv_allocated_len >= self.MAX_CTX:
            return
        slots = self.cache.extend(req, 1)
        if slots is None:
            return
        self.kv[int(slots[0])] = None

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 7), insert=st.booleans(), twice=st.booleans())
    def finish(self, i: int, insert: bool, twice: bool) -> None:
        """Finish (insert) or abort (no insert); a second release must raise."""
        req = self.pick(i, self.live)
        self.release(req, insert)
        if twice:
            free0 = self.cache.allocator.available_size()
            try:
                self.cache.release(req, insert=insert)
            except RuntimeError:
                pass
            else:
                raise AssertionError("second release did not raise")
            assert self.cache.allocator.available_size() == free0

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 7), n=st.integers(0, 30))
    def retract(self, i: int, n: int) -> None:
        req = self.pick(i, self.live)
        self.release(req, insert=True)
        req.num_retractions += 1
        self.waiting.append(req)
        self.cache.evict(n)

    @rule(n=st.integers(0, 50))
    def evict(self, n: int) -> None:
        before = self.cache.prefix.evictable_size()
        got = self.cache.evict(n)
        assert got >= min(n, before), f"evicted {got} of {n} with {before} evictable"
        assert self.cache.prefix.evictable_size() == before - got

    @rule(query=token_seqs(min_size=0), ek=st.sampled_from([None, "a", "b"]), lock=st.booleans())
    def match(self, query: list[int], ek: str | None, lock: bool) -> None:
        m = self.cache.prefix.match(RadixKey(query, ek))
        self.check_match(query, ek, m.device_indices.tolist())
        if lock:
            prot = self.cache.prefix.protected_size()
            self.cache.prefix.lock(m.last_node)
            assert self.cache.prefix.protected_size() >= prot
            self.cache.prefix.unlock(m.last_node)
            assert self.cache.prefix.protected_size() == prot

    # ------------------------------------------------------------ invariants
    @invariant()
    def integrity(self) -> None:
        if not hasattr(self, "cache"):
            return
        self.cache.check_integrity(self.live)
        for req in self.live:
            row = self.cache.req_to_token_pool.req_to_token[req.req_pool_idx].tolist()
            fill = req.fill_ids
            for p in range(req.kv_committed_len):
                assert self.kv.get(row[p]) == (req.extra_key, tuple(fill[:p + 1])), (
                    f"{req.rid}: KV of position {p} was overwritten or never written")

    def teardown(self) -> None:
        if not hasattr(self, "cache"):
            return
        for req in list(self.live):  # drain: everything must come back
            self.release(req, insert=False)
        self.cache.evict(10**9)
        assert self.cache.prefix.total_size() == 0
        assert self.cache.allocator.available_size() == self.cache.allocator.capacity
        self.cache.check_integrity([])


SETTINGS = settings(max_examples=100, stateful_step_count=50, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


class Page4Machine(RadixCacheMachine):
    PAGE_SIZE = 4
    CAPACITY = 32


class NoCacheMachine(RadixCacheMachine):
    DISABLED = True


TestRadixCachePage1 = RadixCacheMachine.TestCase
TestRadixCachePage1.settings = SETTINGS
TestRadixCachePage4 = Page4Machine.TestCase
TestRadixCachePage4.settings = SETTINGS
TestNoPrefixCache = NoCacheMachine.TestCase
TestNoPrefixCache.settings = settings(SETTINGS, max_examples=40)
