"""A bounded index of recent requests' token sequences: n-gram -> the tokens that followed it.

Prompt lookup only sees the request's own context. Requests that resemble each other (the `n`
samples of one prompt in an RL rollout, a shared system prompt answered the same way, the same
code file edited twice) also predict each other, so finished sequences go into this index and
a live request looks its suffix up here too.

Layout: one dict from an n-gram (a tuple of n token ids, n in [min_window, max_window]) to the
`branch_length` tokens that followed its most recent insertion. The dict is kept in LRU order
(a hit or a re-insertion moves the entry to the end) and holds at most `capacity` entries at any
time, also in the middle of an insert; the least recently used go first. An OrderedDict, not a
plain dict: popping a plain dict's oldest key scans past every key deleted before it.

Everything is deterministic: the same inserts and lookups in the same order give the same
drafts, so tests and benchmarks can pin their results.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["IndexMatch", "NgramIndex", "NgramIndexStats"]


@dataclass(frozen=True)
class IndexMatch:
    """The context's last `length` tokens were seen before, followed by `continuation`."""

    length: int
    continuation: tuple[int, ...]


@dataclass
class NgramIndexStats:
    inserted_sequences: int = 0
    inserted_entries: int = 0  # new keys plus refreshed ones
    evicted_entries: int = 0
    lookups: int = 0
    hits: int = 0
    flushes: int = 0


class NgramIndex:
    """n-gram -> continuation, LRU-bounded to `capacity` entries."""

    def __init__(self, capacity: int, min_window: int, max_window: int, branch_length: int):
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        if min_window < 1 or max_window < min_window:
            raise ValueError(f"need 1 <= min_window <= max_window, got {min_window}, {max_window}")
        if branch_length < 1:
            raise ValueError(f"branch_length must be >= 1, got {branch_length}")
        self.capacity = capacity
        self.min_window = min_window
        self.max_window = max_window
        self.branch_length = branch_length
        self._map: OrderedDict[tuple[int, ...], tuple[int, ...]] = OrderedDict()
        self.stats = NgramIndexStats()

    def __len__(self) -> int:
        return len(self._map)

    def insert(self, tokens: Sequence[int], first_key_end: int = 0) -> None:
        """Index `tokens`: every n-gram ending at position >= first_key_end (and before the
        last token, so each has a continuation) maps to the tokens after it.

        first_key_end lets a caller pass left context (the end of a prompt) that serves only
        as the start of keys, without paying for indexing all of it.
        """
        if self.capacity == 0:
            return
        toks = tuple(int(t) for t in tokens)
        n = len(toks)
        self.stats.inserted_sequences += 1
        m = self._map
        # Oldest positions first, so the most recent occurrence of a repeated n-gram is the
        # one that stays (it is inserted last), as in the context lookup.
        for end in range(max(first_key_end, self.min_window), n):
            cont = toks[end:end + self.branch_length]
            for w in range(self.min_window, min(self.max_window, end) + 1):
                key = toks[end - w:end]
                m[key] = cont
                m.move_to_end(key)  # a re-insertion is a use too
                self.stats.inserted_entries += 1
                if len(m) > self.capacity:
                    m.popitem(last=False)
                    self.stats.evicted_entries += 1

    def lookup(self, context: Sequence[int]) -> IndexMatch | None:
        """The longest suffix of `context` (length in [min_window, max_window]) in the index."""
        self.stats.lookups += 1
        n = len(context)
        m = self._map
        wmax = min(self.max_window, n)
        tail = context[n - wmax:]
        # One conversion of the tail (a numpy view or a list) to Python ints for every key.
        tail = tail.tolist() if hasattr(tail, "tolist") else [int(t) for t in tail]
        for w in range(wmax, self.min_window - 1, -1):
            key = tuple(tail[wmax - w:])
            cont = m.get(key)
            if cont is not None:
                # A hit is a use: move it to the tail so it outlives entries nobody asks for.
                m.move_to_end(key)
                self.stats.hits += 1
                return IndexMatch(w, cont)
        return None

    def flush(self) -> None:
        """Forget everything (weight update, flush_cache): the text a new model writes may
        differ, and a stale index only costs acceptance, but keeping it would make drafts
        depend on history the user asked to drop."""
        self._map.clear()
        self.stats.flushes += 1
