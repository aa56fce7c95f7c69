"""Who held the CPUs while a slow abort answer waited: the kernel's context switches around
each of the slowest aborts of an abort_runqueue.py run.

    perf record -k CLOCK_MONOTONIC -e sched:sched_switch -e sched:sched_wakeup -a -o /tmp/s.data -- \\
        python benchmark/micro/abort_runqueue.py 19 --rows /tmp/rows.json
    perf script -i /tmp/s.data -F comm,tid,cpu,time,event,trace > /tmp/s.txt
    python benchmark/micro/sched_trace.py /tmp/rows.json /tmp/s.txt --slowest 4

For each abort it prints, in ms from the abort call, every switch on either CPU
("prev:tid/prio [state] -> next:tid/prio"; prio 120 is nice 0, 139 nice 19) and every wake-up
of the caller's thread and of the engine's loop thread. `perf record -k CLOCK_MONOTONIC` puts
the trace on the clock abort_runqueue.py writes its rows in. docs/cancel_chain.md § Latency
reads one such trace.
"""
from __future__ import annotations

import argparse
import bisect
import json
import re

LINE = re.compile(r"\s*(.+?)\s+(\d+)\s+\[(\d+)\]\s+([\d.]+):\s+(\S+):\s+(.*)")
SWITCH = re.compile(r"prev_comm=(.*?) prev_pid=(\d+) prev_prio=(\d+) prev_state=(\S+) ==> "
                    r"next_comm=(.*?) next_pid=(\d+) next_prio=(\d+)")
WAKEUP = re.compile(r"comm=(.*?) pid=(\d+) prio=(\d+) target_cpu=(\d+)")


def read_events(path: str) -> list[tuple]:
    """(time s, cpu, event, trace text, comm, tid) in time order."""
    events = []
    with open(path) as f:
        for line in f:
            m = LINE.match(line)
            if m:
                events.append((float(m.group(4)), int(m.group(3)), m.group(5), m.group(6), m.group(1),
                               int(m.group(2))))
    events.sort()
    return events


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("rows", help="abort_runqueue.py --rows output")
    ap.add_argument("trace", help="perf script output (fields comm,tid,cpu,time,event,trace)")
    ap.add_argument("--slowest", type=int, default=4)
    args = ap.parse_args()
    with open(args.rows) as f:
        run = json.load(f)
    names = {run["caller_tid"]: " <caller>", run["loop_tid"]: " <loop>"}
    events = read_events(args.trace)
    times = [e[0] for e in events]
    for row in sorted(run["rows"], key=lambda r: -r["answer_ms"])[:args.slowest]:
        t0 = row["t_abort"]
        print(f"=== answer {row['answer_ms']:.2f} ms, abort call {row['abort_call_ms']:.2f} ms, "
              f"caller waited runnable {row['caller_wait_ms']:.2f} ms")
        lo, hi = bisect.bisect_left(times, t0 - 0.002), bisect.bisect_right(times, row["t_answer"] + 0.0005)
        for t, cpu, event, trace, comm, tid in events[lo:hi]:
            at = f"{(t - t0) * 1e3:8.3f} cpu{cpu}"
            if event.endswith("sched_switch"):
                m = SWITCH.match(trace)
                if m:
                    pc, pp, ppr, state, nc, np_, npr = m.groups()
                    print(f"{at} {pc}:{pp}/{ppr}{names.get(int(pp), '')} [{state}] -> "
                          f"{nc}:{np_}/{npr}{names.get(int(np_), '')}")
            else:
                m = WAKEUP.match(trace)
                if m and int(m.group(2)) in names:
                    print(f"{at} wakes {m.group(1)}:{m.group(2)}/{m.group(3)}{names[int(m.group(2))]} "
                          f"(by {comm}:{tid}) on cpu{int(m.group(4))}")


if __name__ == "__main__":
    main()
