"""The storage tier: HiCache's third tier, under the host tier (docs/semantics.md §6).

Two worker threads talk to the backend; the scheduler's thread never does (a dead backend can
block for seconds):
- **backup**: once a node's host copy is written (its write acked, per the write policy), the
  whole storage pages of its root path not known to be stored are copied out of the host pool
  (a memory copy, on the scheduler thread, so host slots may be reused at once) and handed to
  the backup thread, which skips pages the backend already has and writes the rest.
- **prefetch**: a waiting request whose prompt continues past the tree (device and host) by at
  least `prefetch_threshold` tokens starts one prefetch: the thread finds the run of stored
  pages past the prompt's host-backed prefix and reads them (checksum verified). `poll()` puts
  finished prefetches into the tree as host copies (storage_insert.py); admission then loads
  them back like any host hit.

Admission (`ready`) follows the prefetch policy: `best_effort` admits at once (the pages serve
later requests), `wait_complete` once the prefetch has finished, `timeout` once it has finished
or `prefetch_timeout` seconds have passed. A backend error, a corrupt page (deleted, so that a
later backup replaces it) or a timeout only shortens what is loaded: the rest is recomputed.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from radixlm.hicache.host_tier import HiTreeNode, hi
from radixlm.hicache.storage import (
    CorruptPage,
    StorageBackend,
    decode_page,
    encode_page,
    layout_fingerprint,
    namespace_seed,
    page_keys,
    storage_page_tokens,
)
from radixlm.hicache.storage_insert import insert_fetched
from radixlm.radix_cache.prefix_cache import RadixKey

if TYPE_CHECKING:
    from radixlm.hicache.hiradix_cache import HiRadixCache

logger = logging.getLogger(__name__)

__all__ = ["StorageTier", "PREFETCH_POLICIES", "StorageOptions"]

PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
# Requests remembered as "prefetch settled" (so that a request turned away by the budget does
# not query storage again); the oldest are forgotten first.
_SETTLED_MEMORY = 4096
# Pages copied out for backup but not yet written: beyond this a slow backend loses backups
# (counted) instead of the process growing without bound.
MAX_PENDING_BACKUP_PAGES = 1024


@dataclass(frozen=True)
class StorageOptions:
    prefetch_policy: str = "best_effort"
    prefetch_threshold: int = 256  # tokens past the tree before a prefetch is worth a query
    prefetch_timeout: float = 2.0  # seconds, for the "timeout" policy
    model_id: str = ""  # part of every key's namespace


@dataclass(eq=False)
class _Prefetch:
    key: RadixKey
    start: int  # first token of the first page read
    future: Future[list[torch.Tensor] | None]
    started: float
    generation: int
    covers: frozenset[str] = frozenset()  # page keys it reads (a request sharing them shares the read)
    waited: bool = False
    owner_gone: bool = False  # its request no longer waits for it (best_effort, timed out)


@dataclass
class _Counters:
    values: dict[str, int] = field(default_factory=lambda: dict.fromkeys((
        "storage_hit_tokens", "prefetch_ops", "prefetched_pages", "prefetch_inserted_tokens",
        "prefetch_waits", "prefetch_timeouts", "prefetch_below_threshold", "backup_pages_written",
        "backup_pages_skipped", "backup_pages_dropped", "corrupt_pages", "backend_errors"), 0))
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, name: str, n: int = 1) -> None:
        with self.lock:  # worker threads count too
            self.values[name] += n


class StorageTier:
    def __init__(self, cache: HiRadixCache, backend: StorageBackend, options: StorageOptions) -> None:
        if options.prefetch_policy not in PREFETCH_POLICIES:
            raise ValueError(f"unknown prefetch policy {options.prefetch_policy!r}; choose from {PREFETCH_POLICIES}")
        self.cache = cache
        self.backend = backend
        self.options = options
        self.page_tokens = storage_page_tokens(cache.page_size)
        self.like = [b[:1].clone() for b in cache.host_pool.buffers]  # per-token layout of a page
        self.layout = layout_fingerprint(cache.host_pool.buffers)
        self._workers = {k: ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"radixlm-storage-{k}")
                         for k in ("backup", "prefetch")}
        self.counters = _Counters()
        self.prefetches: dict[str, _Prefetch] = {}  # owner (request id) -> its prefetch
        self.settled: OrderedDict[str, None] = OrderedDict()  # owners whose prefetch is over
        self.stored: OrderedDict[str, None] = OrderedDict()  # page keys known to be in storage
        self.pending_backup_pages = 0
        self._pending_lock = threading.Lock()
        self._not_stored: list[str] = []  # keys the workers found unwritten or corrupt (under the lock)
        self.generation = 0  # a flush makes prefetches of the old tree worthless

    # ------------------------------------------------------------------ keys
    def keys_for(self, key: RadixKey) -> list[str]:
        seed = namespace_seed(self.options.model_id, self.layout, key.extra_key)
        return page_keys(key.token_ids, self.page_tokens, seed)

    def _remember_stored(self, keys: list[str]) -> None:
        for k in keys:
            self.stored[k] = None
            self.stored.move_to_end(k)
        while len(self.stored) > 1 << 16:
            self.stored.popitem(last=False)

    # ------------------------------------------------------------------ backup (host -> storage)
    def on_host_written(self, node: HiTreeNode) -> None:
        """`node`'s host copy is complete: store the whole pages of its root path."""
        path: list[HiTreeNode] = []
        x: HiTreeNode | None = node
        while x is not None and x.parent is not None:
            path.append(x)
            x = hi(x.parent)
        path.reverse()
        tokens: list[int] = []
        slots: list[torch.Tensor] = []
        for p in path:
            if p.host_value is None or self.cache.host_pending(p):
                break  # write_back may back a node up before its parent: store what is contiguous
            tokens += p.key.token_ids
            slots.append(p.host_value)
        if len(tokens) < self.page_tokens:
            return
        keys = self.keys_for(RadixKey(tokens, node.key.extra_key))
        todo = [i for i, k in enumerate(keys) if k not in self.stored]
        if not todo:
            return
        with self._pending_lock:
            if self.pending_backup_pages + len(todo) > MAX_PENDING_BACKUP_PAGES:
                self.counters.add("backup_pages_dropped", len(todo))
                return
            self.pending_backup_pages += len(todo)
        host = torch.cat(slots)
        pt = self.page_tokens
        idx = torch.cat([host[i * pt:(i + 1) * pt] for i in todo])
        rows = [b.index_select(0, idx) for b in self.cache.host_pool.buffers]
        pages = [(keys[i], [r[j * pt:(j + 1) * pt] for r in rows]) for j, i in enumerate(todo)]
        self._remember_stored([keys[i] for i in todo])
        self._workers["backup"].submit(self._write_pages, pages)

    def _write_pages(self, pages: list[tuple[str, list[torch.Tensor]]]) -> None:
        try:
            for key, rows in pages:
                try:
                    if self.backend.exists(key):
                        self.counters.add("backup_pages_skipped")
                    else:
                        self.backend.set(key, encode_page(key, rows))
                        self.counters.add("backup_pages_written")
                except Exception as e:  # noqa: BLE001 - any backend failure only costs this page
                    # Still counted as stored: a broken backend is not asked again for every
                    # later backup of the same path (a corrupt page, found on read, is).
                    self.counters.add("backend_errors")
                    logger.warning("HiCache storage: writing page %s failed: %s", key, e)
        finally:
            with self._pending_lock:
                self.pending_backup_pages -= len(pages)

    # ------------------------------------------------------------------ prefetch (storage -> host)
    def ready(self, key: RadixKey, owner: str, now: float | None = None) -> bool:
        """Whether the request `owner` (prompt `key`) may be admitted now; starts its prefetch
        the first time it is asked."""
        now = time.monotonic() if now is None else now
        if owner in self.settled:
            return True
        op = self.prefetches.get(owner)
        if op is None:
            op = self._start(key, now)
            if op is None:
                self._settle(owner)
                return True
            self.prefetches[owner] = op
        if op.owner_gone:
            return True
        policy = self.options.prefetch_policy
        if policy == "best_effort":
            op.owner_gone = True
            return True
        if policy == "timeout" and now - op.started >= self.options.prefetch_timeout:
            self.counters.add("prefetch_timeouts")
            op.owner_gone = True  # it still lands in the tree for later requests
            return True
        if not op.waited:
            op.waited = True
            self.counters.add("prefetch_waits")
        return False

    def _start(self, key: RadixKey, now: float) -> _Prefetch | None:
        path = self.cache.walk(key, count_hit=False)
        have = sum(len(n.key) for n in path)
        whole = len(key) // self.page_tokens * self.page_tokens
        if whole - have < max(self.options.prefetch_threshold, 1):
            self.counters.add("prefetch_below_threshold")
            return None
        hosted = 0
        for n in path:
            if hi(n).host_value is None:
                break
            hosted += len(n.key)
        first = hosted // self.page_tokens
        keys = self.keys_for(key)
        for other in self.prefetches.values():
            if keys[-1] in other.covers and other.start <= first * self.page_tokens:
                # The same prefix is being read for another request (n > 1, a shared system
                # prompt): wait for that read instead of repeating it.
                return _Prefetch(other.key, other.start, other.future, now, other.generation, other.covers)
        self.counters.add("prefetch_ops")
        future = self._workers["prefetch"].submit(self._read_pages, keys[first:], have - first * self.page_tokens)
        return _Prefetch(key, first * self.page_tokens, future, now, self.generation, frozenset(keys[first:]))

    def _read_pages(self, keys: list[str], threshold_skip: int) -> list[torch.Tensor] | None:
        """The longest run of stored pages from the start of `keys`, read and checked; None
        when the run does not reach past what the tree holds by the threshold."""
        try:
            hits = 0
            for k in keys:
                if not self.backend.exists(k):
                    break
                hits += 1
            if hits * self.page_tokens - threshold_skip < max(self.options.prefetch_threshold, 1):
                self.counters.add("prefetch_below_threshold")
                return None
            pages: list[list[torch.Tensor]] = []
            for k in keys[:hits]:
                blob = self.backend.get(k)
                if blob is None:
                    break
                try:
                    pages.append(decode_page(k, blob, self.like, self.page_tokens))
                except CorruptPage as e:
                    self.counters.add("corrupt_pages")
                    self.counters.add("backend_errors")
                    logger.warning("HiCache storage: %s; deleting it", e)
                    self._forget_stored(k)
                    self.backend.delete(k)
                    break
        except Exception as e:  # noqa: BLE001 - a failing backend means recomputation, nothing more
            self.counters.add("backend_errors")
            logger.warning("HiCache storage: prefetch failed: %s", e)
            return None
        if not pages:
            return None
        self.counters.add("prefetched_pages", len(pages))
        return [torch.cat([p[b] for p in pages]) for b in range(len(self.like))]

    def _forget_stored(self, key: str) -> None:
        """Worker threads: `key` is not (validly) stored, so a later backup writes it again."""
        with self._pending_lock:
            self._not_stored.append(key)

    def poll(self) -> None:
        """Scheduler thread, top of every iteration: finished prefetches enter the tree."""
        with self._pending_lock:
            gone, self._not_stored = self._not_stored, []
        for k in gone:
            self.stored.pop(k, None)
        landed: set[Future[list[torch.Tensor] | None]] = set()
        for owner, op in list(self.prefetches.items()):
            if not op.future.done():
                continue
            del self.prefetches[owner]
            rows = op.future.result()
            if rows is not None and op.generation == self.generation and op.future not in landed:
                landed.add(op.future)
                n = insert_fetched(self.cache, op.key, op.start, rows)
                self.counters.add("prefetch_inserted_tokens", n)
                self.counters.add("storage_hit_tokens", int(rows[0].shape[0]))
                self._remember_stored(self.keys_for(op.key[:op.start + int(rows[0].shape[0])]))
            self._settle(owner)

    def _settle(self, owner: str) -> None:
        self.settled[owner] = None
        while len(self.settled) > _SETTLED_MEMORY:
            self.settled.popitem(last=False)

    def in_flight(self) -> bool:
        return bool(self.prefetches)

    def wait_idle(self) -> None:
        """Tests, flush: let every backup and prefetch finish (blocks on the backend)."""
        for w in self._workers.values():
            w.submit(lambda: None).result()
        self.poll()

    def clear(self) -> None:
        self.generation += 1
        self.stored.clear()

    def close(self) -> None:
        for w in self._workers.values():
            w.shutdown(wait=False, cancel_futures=True)
        self.backend.close()

    def summary(self) -> dict[str, Any]:
        with self.counters.lock:
            out: dict[str, Any] = dict(self.counters.values)
        out.update(storage_backend=self.backend.name, prefetch_policy=self.options.prefetch_policy,
                   prefetch_in_flight=len(self.prefetches), pending_backup_pages=self.pending_backup_pages,
                   storage_page_tokens=self.page_tokens)
        return out
