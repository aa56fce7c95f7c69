"""The periodic step lines at info level, in SGLang's words so that the same log readers work:

    Prefill batch. #new-seq: 2, #new-token: 96, #cached-token: 32, token usage: 0.12, #running-req: 3, #queue-req: 1
    Decode batch. #running-req: 4, #token: 812, token usage: 0.20, gen throughput (token/s): 41.37, #queue-req: 0

One line per prefill batch; one decode line every `decode_log_interval` decode steps, whose
throughput is the tokens decoded since the previous decode line over the time since it. Token
usage is the KV pool's share held by requests or the tree and not evictable.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from radixlm.scheduler.cache_manager import CacheManager

__all__ = ["StepLog"]

logger = logging.getLogger(__name__)


def _used(cache: CacheManager) -> int:
    return cache.capacity - cache.available() - cache.evictable()


@dataclass
class StepLog:
    decode_interval: int = 40
    _decode_steps: int = 0
    _last_tokens: int = 0  # decode tokens counted at the previous decode line
    _last_time: float = field(default_factory=time.perf_counter)

    def prefill(self, cache: CacheManager, new_seqs: int, new_tokens: int, cached_tokens: int,
                running: int, queued: int) -> None:
        if not logger.isEnabledFor(logging.INFO):
            return
        used = _used(cache)
        logger.info("Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, token usage: %.2f, "
                    "#running-req: %d, #queue-req: %d", new_seqs, new_tokens, cached_tokens,
                    used / max(cache.capacity, 1), running, queued)

    def decode(self, cache: CacheManager, running: int, decode_tokens_total: int, queued: int) -> None:
        """A decode step was built; `decode_tokens_total`: the scheduler's running count."""
        self._decode_steps += 1
        if self._decode_steps % self.decode_interval or not logger.isEnabledFor(logging.INFO):
            return
        now = time.perf_counter()
        rate = (decode_tokens_total - self._last_tokens) / max(now - self._last_time, 1e-9)
        self._last_tokens, self._last_time = decode_tokens_total, now
        used = _used(cache)
        logger.info("Decode batch. #running-req: %d, #token: %d, token usage: %.2f, gen throughput (token/s): "
                    "%.2f, #queue-req: %d", running, used, used / max(cache.capacity, 1), rate, queued)
