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
- `--scheduler-policy fifo` leaves the scheduler processes alone and runs the front end's loop
  thread under `SCHED_FIFO` (real-time, priority 1): a real-time thread is outside the fair
  scheduler's eligibility rule above, so it takes a CPU the moment it wakes, whoever ran there.
  Threads and processes it starts begin as normal ones (`SCHED_RESET_ON_FORK`): tokenization in
  the executor's threads and the ZMQ I/O threads never run real-time. A caller whose own thread is
  `SCHED_FIFO` too gets its answer back the same way (docs/cancel_chain.md § Latency has the
  measurements). Setting it needs `CAP_SYS_NICE` or an `RLIMIT_RTPRIO` of at least 1.

All are Linux scheduling attributes; elsewhere they are ignored with a warning. A new thread
inherits its creator's policy and niceness, so each is set before the thread starts others.
"""
from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

SCHEDULER_POLICIES = ("normal", "idle", "fifo")


def _set_policy(policy_name: str, priority: int = 0, reset_on_fork: bool = False) -> None:
    policy = getattr(os, policy_name, None)
    if policy is None or not hasattr(os, "sched_setscheduler"):
        logger.warning("%s is not available on this platform; the thread keeps its policy", policy_name)
        return
    if reset_on_fork:
        policy |= os.SCHED_RESET_ON_FORK
    try:
        os.sched_setscheduler(0, policy, os.sched_param(priority))  # 0: the calling thread on Linux
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
    """In a thread that answers callers (an event loop the TokenizerManager runs on). With
    `--scheduler-policy idle` (the forward under SCHED_IDLE): SCHED_BATCH, so that waking it
    never preempts the caller that woke it, while it still preempts the forward at once. With
    `fifo`: SCHED_FIFO at priority 1, reset to normal in the threads it starts."""
    if policy == "idle":
        _set_policy("SCHED_BATCH")
    elif policy == "fifo":
        _set_policy("SCHED_FIFO", priority=1, reset_on_fork=True)
