"""The grammar queue: structured-output requests wait here while their grammar compiles.

A request with `json_schema`, `regex` or `ebnf` does not enter the waiting queue at once:
its grammar is compiled on a small thread pool (compiling a JSON schema against a 49k
vocabulary takes milliseconds to seconds) so the scheduler loop never blocks on it. The
scheduler polls the queue at the top of every iteration; a request whose compile is done
gets its own matcher and moves to the waiting queue, one whose compile failed is answered
with a 400 abort (semantics §1, §3 method 2).

Compiles are cached by (kind, grammar text) as futures, so parallel-sampling children and
repeated schemas compile once, and a request arriving while the same grammar is compiling
simply waits on that compile.

This layer knows nothing about xgrammar: the compiler and the matchers come from a
`GrammarBackend` handed to the scheduler (see radixlm/srt/constrained/).
"""
from __future__ import annotations

import collections
import logging
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any, Protocol

from radixlm.core import FinishReason, Req
from radixlm.rank_sync import LOCAL_RANK, RankSync

logger = logging.getLogger(__name__)

# Compiled grammars kept for reuse (a JSON schema's compiled form can be megabytes).
COMPILE_CACHE_SIZE = 256
# An otherwise idle scheduler waits this long for a compile before looking at its inbox again.
COMPILE_POLL_S = 0.005


class GrammarBackend(Protocol):
    """What the scheduler needs from a structured-output library."""

    def compile(self, kind: str, spec: str) -> Any:
        """Compile one grammar (called on a pool thread). Raises ValueError on a bad grammar."""

    def new_matcher(self, compiled: Any) -> Any:
        """A fresh matcher at the grammar's start (cheap; one per request)."""


class GrammarQueue:
    """Requests waiting for their compiled grammar, in arrival order. Truthy while any waits.

    Without a backend (xgrammar not installed) the queue stays empty: the scheduler answers
    structured requests with 400 instead of queueing them (see `available`)."""

    def __init__(self, backend: GrammarBackend | None, num_threads: int = 2,
                 cache_size: int = COMPILE_CACHE_SIZE) -> None:
        self.backend = backend
        self._num_threads = num_threads
        self._pool: ThreadPoolExecutor | None = None  # started by the first structured request
        self._cache: collections.OrderedDict[tuple[str, str], Future] = collections.OrderedDict()
        self._cache_size = cache_size
        # keyed by id(req): insertion order is arrival order (fairness), removal is O(1)
        self._pending: dict[int, tuple[Req, tuple[str, str]]] = {}
        # Tensor-parallel ranks admit a request only once its compile is done on every rank.
        self.ranks: RankSync = LOCAL_RANK
        self.stats = {"grammar_compiles": 0, "grammar_cache_hits": 0, "grammar_compile_errors": 0,
                      "grammar_compiles_cancelled": 0}

    # ------------------------------------------------------------------ queue
    def __len__(self) -> int:
        return len(self._pending)

    @property
    def available(self) -> bool:
        return self.backend is not None

    @property
    def reqs(self) -> list[Req]:
        return [req for req, _ in self._pending.values()]

    def add(self, req: Req, key: tuple[str, str]) -> None:
        self._pending[id(req)] = (req, key)
        fut = self._cache.get(key)
        if fut is not None and not fut.cancelled():
            self._cache.move_to_end(key)
            self.stats["grammar_cache_hits"] += 1
            return
        self.stats["grammar_compiles"] += 1
        self._cache[key] = self._submit(key)
        self._trim()

    def _submit(self, key: tuple[str, str]) -> Future:
        assert self.backend is not None, "no grammar backend"
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self._num_threads, thread_name_prefix="radixlm-grammar")
        return self._pool.submit(self.backend.compile, *key)

    def _trim(self) -> None:
        """Least recently used finished entries go first. An entry a request waits for is never
        dropped (the cache may exceed its size while that many distinct grammars compile), so
        every pending request's key is always in the cache."""
        if len(self._cache) <= self._cache_size:
            return
        waited = {key for _, key in self._pending.values()}
        for key in [k for k, f in self._cache.items() if f.done() and k not in waited]:
            if len(self._cache) <= self._cache_size:
                break
            del self._cache[key]

    def remove(self, req: Req) -> bool:
        """Take an aborted request out; cancel its compile if nobody else waits for it and it
        has not started (a running compile cannot be interrupted; its result stays cached).
        Returns whether a compile was cancelled."""
        _, key = self._pending.pop(id(req))
        if any(k == key for _, k in self._pending.values()):
            return False
        fut = self._cache.get(key)
        if fut is not None and fut.cancel():
            del self._cache[key]
            self.stats["grammar_compiles_cancelled"] += 1
            return True
        return False

    def pop_ready(self) -> tuple[list[Req], list[tuple[Req, FinishReason]]]:
        """Requests whose compile finished: (ready, each with its own matcher in req.grammar;
        failed, each with the 400 abort to answer it with)."""
        ready: list[Req] = []
        failed: list[tuple[Req, FinishReason]] = []
        pending = list(self._pending.items())
        done = self.ranks.agree_done([int(self._cache[key].done()) for _, (_, key) in pending]) if pending else []
        for (rid_key, (req, key)), is_done in zip(pending, done):
            fut = self._cache[key]
            if not is_done:
                continue
            del self._pending[rid_key]
            error = fut.exception()
            if error is None:
                try:
                    req.grammar = self.backend.new_matcher(fut.result())
                except Exception as e:  # noqa: BLE001 - one request's matcher must not stop the loop
                    error = e
                else:
                    ready.append(req)
                    continue
            self.stats["grammar_compile_errors"] += 1
            failed.append((req, FinishReason.abort(f"invalid {key[0]}: {_describe(error)}", status_code=400)))
        return ready, failed

    def wait(self, timeout: float = COMPILE_POLL_S) -> None:
        """Block until some pending compile is done, or timeout (the loop has nothing else to do)."""
        futures = [self._cache[key] for _, key in self._pending.values()]
        if futures:
            wait(futures, timeout=timeout, return_when=FIRST_COMPLETED)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def _describe(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return text if len(text) <= 500 else text.splitlines()[0][:500]


def grammar_finish(req: Req, status: str | None, token: int) -> None:
    """Turn the forward side's verdict on the token just appended into a finish reason."""
    if status is None or req.finished:
        return
    if status == "terminated":
        req.finish_reason = FinishReason("stop", matched=token)
    elif status == "error":
        req.finish_reason = FinishReason.abort("internal error: the grammar matcher failed", status_code=500)
    elif status == "rejected":
        # Cannot happen while the mask is applied; answer rather than emit invalid output.
        logger.error("%s: the grammar rejected sampled token %d", req.rid, token)
        req.finish_reason = FinishReason.abort(f"internal error: the grammar rejected token {token}",
                                               status_code=500)
