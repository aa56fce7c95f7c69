"""CPU priorities of the runtime's threads: the forward yields to whoever answers callers.

On a machine whose cores are all busy with the forward's OpenMP threads, a caller's answer
waits for a CPU at every hand-over between threads (docs/cancel_chain.md § Latency). Two
settings shape this:

- `--scheduler-nice N` lowers the scheduler processes' priority (the forward included).
- `--scheduler-policy idle` runs them under Linux `SCHED_IDLE`, which every normal thread
  preempts at once when it wakes. It also makes the front-end threads of this process (the
  Engine's loop, the HTTP server's loop) `SCHED_BATCH`: a batch thread still preempts an
  idle one, but never the normal thread that woke it. The measured reason (Linux 6.18's
  EEVDF, a 4 ms tick): when a caller hands an abort to the loop thread on its own CPU and the
  loop preempts it, the caller is left runnable with a slightly negative lag; when the loop
  sleeps again, the low-weight forward thread is the only eligible one and holds the CPU until
  the next tick, 4-5 ms. Without that preemption the caller runs on until it blocks.

Both are Linux scheduling attributes; elsewhere they are ignored with a warning. A new thread
inherits its creator's policy and niceness, so each is set before the thread starts others.
"""
from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

SCHEDULER_POLICIES = ("normal", "idle")


def _set_policy(policy_name: str) -> None:
    policy = getattr(os, policy_name, None)
    if policy is None or not hasattr(os, "sched_setscheduler"):
        logger.warning("%s is not available on this platform; the thread keeps its policy", policy_name)
        return
    try:
        os.sched_setscheduler(0, policy, os.sched_param(0))  # 0: the calling thread on Linux
    except OSError as e:
        logger.warning("could not set %s: %s", policy_name, e)


def lower_forward_priority(nice: int, policy: str) -> None:
    """In a scheduler process, before torch starts its threads: `--scheduler-nice` and
    `--scheduler-policy`."""
    if nice > 0:
        os.nice(nice)
    if policy == "idle":
        _set_policy("SCHED_IDLE")


def front_end_thread(policy: str) -> None:
    """In a thread that answers callers (an event loop the TokenizerManager runs on), when the
    forward runs under `--scheduler-policy idle`: SCHED_BATCH, so that waking it never
    preempts the caller that woke it, while it still preempts the forward at once."""
    if policy == "idle":
        _set_policy("SCHED_BATCH")
