"""The CPU priorities the runtime's threads take (radixlm/srt/cpu_priority.py)."""
import os
import subprocess
import sys
import threading

import pytest

from radixlm.srt.cpu_priority import front_end_thread

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_getscheduler"), reason="Linux scheduling policies")


def policy_in_thread(policy: str) -> int:
    seen = []

    def body():
        front_end_thread(policy)
        seen.append(os.sched_getscheduler(0))
    t = threading.Thread(target=body)
    t.start()
    t.join()
    return seen[0]


def test_front_end_threads_take_batch_only_beside_an_idle_forward():
    assert policy_in_thread("normal") == os.SCHED_OTHER
    assert policy_in_thread("idle") == os.SCHED_BATCH
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the thread's own, not the process's


@pytest.mark.parametrize("nice, policy, want", [(0, "normal", os.SCHED_OTHER), (3, "idle", os.SCHED_IDLE)])
def test_the_forward_priority_reaches_threads_started_after_it(nice, policy, want):
    code = ("import os, threading\n"
            "from radixlm.srt.cpu_priority import lower_forward_priority\n"
            f"base = os.getpriority(os.PRIO_PROCESS, 0)\n"
            f"lower_forward_priority({nice}, {policy!r})\n"
            "got = []\n"
            "t = threading.Thread(target=lambda: got.append((os.sched_getscheduler(0), "
            "os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) - base)))\n"
            "t.start(); t.join(); print(*got[0])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    got_policy, got_nice = map(int, out.stdout.split())
    assert got_policy == want
    assert got_nice == nice or got_nice == 19 - os.getpriority(os.PRIO_PROCESS, 0)  # capped at 19
