"""Thread wake-up latency on this machine, beside CPU load of a chosen priority; prints JSON.

    python benchmark/micro/wakeup_probe.py [--policies none,normal,nice5,nice19,idle] [--trips 800]

What the Engine's abort answer crosses, without the engine: a caller thread hands a coroutine to
an asyncio loop on another thread (`run_coroutine_threadsafe`) and blocks until it returns, at
random intervals of 2-20 ms. Beside it run two load processes (one per core of a 2-core machine;
`--load-procs`), each one torch thread of 1k x 1k matmuls and a 64 MB read, at the policy named:
none (no load), normal, niceN, idle (SCHED_IDLE). Reported per policy: the round trip's
p50 / p90 / p99 / max in ms (nearest rank), the hand-over alone (caller -> loop), and how many
trips took over 3 ms. docs/cancel_chain.md § Latency has what it showed.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import subprocess
import sys
import threading
import time

LOAD = """
import os, sys, time, torch
torch.set_num_threads(1)
p = sys.argv[1]
if p == "idle":
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
elif p.startswith("nice"):
    os.nice(int(p[4:]))
a, b, w = torch.randn(1024, 1024), torch.randn(1024, 1024), torch.randn(16_000_000)
while True:
    for _ in range(20):
        a @ b
    w.sum()
"""


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return round(s[max(0, math.ceil(q * len(s)) - 1)], 3)


def probe(policy: str, trips: int, load_procs: int) -> dict:
    procs = [] if policy == "none" else [subprocess.Popen([sys.executable, "-c", LOAD, policy])
                                          for _ in range(load_procs)]
    try:
        time.sleep(3.0 if procs else 0.1)  # the load is running before the first trip
        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, daemon=True).start()

        async def stamp() -> float:
            return time.perf_counter()
        rng = random.Random(0)
        rt, hop = [], []
        for _ in range(trips):
            time.sleep(rng.uniform(0.002, 0.02))
            t0 = time.perf_counter()
            t1 = asyncio.run_coroutine_threadsafe(stamp(), loop).result()
            t2 = time.perf_counter()
            rt.append(1e3 * (t2 - t0))
            hop.append(1e3 * (t1 - t0))
        loop.call_soon_threadsafe(loop.stop)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    return {"policy": policy, "round_trip_ms": {"p50": pct(rt, .5), "p90": pct(rt, .9), "p99": pct(rt, .99),
                                                "max": round(max(rt), 3)},
            "hand_over_p99_ms": pct(hop, .99), "trips_over_3ms": sum(r > 3.0 for r in rt)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policies", default="none,normal,nice5,nice19,idle")
    ap.add_argument("--trips", type=int, default=800)
    ap.add_argument("--load-procs", type=int, default=os.cpu_count() or 2)
    args = ap.parse_args()
    runs = [probe(p, args.trips, args.load_procs) for p in args.policies.split(",")]
    print(json.dumps({"benchmark": "wakeup_probe", "cpus": os.cpu_count(), "trips": args.trips,
                      "load_procs": args.load_procs, "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
