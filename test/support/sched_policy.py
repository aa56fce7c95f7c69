"""Linux scheduling policies for the tests of --scheduler-policy: whether a real-time policy may
be set here, and each thread's policy."""
from __future__ import annotations

import os
import subprocess
import sys


def fifo_permitted() -> bool:
    """Whether a process here may take SCHED_FIFO (CAP_SYS_NICE or an RLIMIT_RTPRIO)."""
    code = "import os; os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60).returncode == 0


def task_policies(pid: int) -> dict[int, int]:
    """Every thread of a process: its policy, without the SCHED_RESET_ON_FORK flag."""
    policies = {}
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            policies[int(task)] = os.sched_getscheduler(int(task)) & ~os.SCHED_RESET_ON_FORK
        except ProcessLookupError:  # a thread that ended meanwhile
            pass
    return policies
