"""What the scheduler is configured with (built from ServerArgs by ServerArgs.scheduler_config)."""
from __future__ import annotations

from dataclasses import dataclass

from radixlm.speculative.drafter import NgramConfig

__all__ = ["SchedulerConfig", "PriorityConfig"]


@dataclass(frozen=True)
class PriorityConfig:
    """--enable-priority-scheduling and its flags (scheduler/priority.py)."""
    low_values_first: bool = False
    # a running request is preempted only for a waiting one at least this many priority units
    # above it (and never for an equal or lower one)
    preemption_threshold: int = 10
    default_priority: int = 0  # the priority of a request that gives none


@dataclass(frozen=True)
class SchedulerConfig:
    max_running_requests: int
    chunked_prefill_size: int | None  # None: no chunking
    # a decode step between the chunks of a long prompt while requests are decoding
    interleave_chunked_prefill: bool = True
    # ModelConfig.chunk_cost_keys: with it, while requests decode, a chunk over a long cached
    # prefix is shortened so that it costs no more than chunked_prefill_size tokens without one
    # (prefill.py, PrefillAdder); None: chunks are chunked_prefill_size tokens whatever the prefix
    chunk_cost_keys: int | None = None
    max_prefill_tokens: int = 16384
    page_size: int = 1
    schedule_policy: str = "fcfs"  # a SCHEDULE_POLICIES name
    schedule_conservativeness: float = 1.0
    retraction_policy: str = "length"  # a RETRACTION_POLICIES name
    random_seed: int = 0
    max_queued_requests: int | None = None
    request_waiting_timeout: float | None = None
    request_running_timeout: float | None = None
    overlap: bool = False  # launch batch N+1 while processing batch N
    stream_interval: int = 1
    debug_check_integrity: bool = False
    speculative: NgramConfig | None = None  # n-gram speculative decoding (scheduler/speculation.py)
    decode_log_interval: int = 40  # decode steps between two "Decode batch" info lines (step_log.py)
    priority: PriorityConfig | None = None  # None: priority scheduling off (every rank 0)
