"""The CPU priorities the runtime's threads take (radixlm/srt/cpu_priority.py)."""
import os
import subprocess
import sys
import threading

import pytest

from radixlm.srt.cpu_priority import front_end_thread
from test.support.sched_policy import fifo_permitted

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


def test_a_fifo_front_end_thread_is_real_time_and_starts_only_normal_threads_and_processes():
    if not fifo_permitted():
        pytest.skip("SCHED_FIFO needs CAP_SYS_NICE or RLIMIT_RTPRIO here")
    seen = {}

    def body():
        front_end_thread("fifo")
        policy = os.sched_getscheduler(0)
        seen["loop"] = (policy & ~os.SCHED_RESET_ON_FORK, os.sched_getparam(0).sched_priority)
        child = threading.Thread(target=lambda: seen.setdefault("thread", os.sched_getscheduler(0)))
        child.start()
        child.join()
        code = "import os; print(os.sched_getscheduler(0))"
        seen["process"] = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                             timeout=60, check=True).stdout)
    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert seen["loop"] == (os.SCHED_FIFO, 1)
    # tokenization in the executor's threads, the ZMQ I/O threads, a launched child: never real-time
    assert seen["thread"] == os.SCHED_OTHER
    assert seen["process"] == os.SCHED_OTHER
    assert os.sched_getscheduler(0) == os.SCHED_OTHER


def test_a_front_end_thread_not_allowed_real_time_warns_and_runs_on(monkeypatch, caplog):
    def refuse(pid, policy, param):
        raise PermissionError(1, "Operation not permitted")
    monkeypatch.setattr(os, "sched_setscheduler", refuse)
    with caplog.at_level("WARNING", logger="radixlm.srt.cpu_priority"):
        front_end_thread("fifo")
    assert "could not set SCHED_FIFO" in caplog.text
    assert os.sched_getscheduler(0) == os.SCHED_OTHER


@pytest.mark.parametrize("nice, policy, want", [(0, "normal", os.SCHED_OTHER), (3, "idle", os.SCHED_IDLE),
                                              (0, "fifo", os.SCHED_OTHER)])  # fifo: only the front end
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
