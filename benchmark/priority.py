"""TTFT of a high-priority class under a low-priority load, with and without preemption.

    python benchmark/priority.py [--model-path DIR] [--max-running 4] [--low 24] [--high 12]
                                 [--interval 0.25] [--out F.json]

`--low` long low-priority requests (priority 0) are queued at once, filling the running slots
(`--max-running`); then `--high` short requests of priority 100 arrive one every `--interval`
seconds. Three servers (in-process Engines, the same workload):
- fcfs: no priority scheduling (the high ones wait behind the queue);
- queue_only: priority scheduling whose preemption threshold cannot be met (they go first in
  the queue, but wait for a running slot);
- preempt: priority scheduling with preemption (a running low one is retracted for each).
TTFT = time from a request's submission to its first streamed chunk (wall clock). Reported
per mode: the high class's p50 / p99 TTFT, the low class's p50 TTFT and total time, and the
retractions. Percentiles are nearest-rank.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import emit  # noqa: E402

MODES = {"fcfs": {}, "queue_only": {"enable_priority_scheduling": True,
                                    "priority_scheduling_preemption_threshold": 1000},
         "preempt": {"enable_priority_scheduling": True, "priority_scheduling_preemption_threshold": 1}}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, max(0, int(round(q * len(xs))) - 1))], 4)


async def one(engine, ids: list[int], sp: dict, priority: int) -> tuple[float, float]:
    """(TTFT, end-to-end) of one streamed request."""
    t0 = time.perf_counter()
    first = None
    agen = await engine.async_generate(input_ids=ids, sampling_params=sp, stream=True, priority=priority)
    async for _ in agen:
        if first is None:
            first = time.perf_counter() - t0
    return first or 0.0, time.perf_counter() - t0


async def workload(engine, args) -> dict:
    low_sp = {"max_new_tokens": args.low_tokens, "temperature": 0.0, "ignore_eos": True}
    high_sp = {"max_new_tokens": args.high_tokens, "temperature": 0.0, "ignore_eos": True}
    t0 = time.perf_counter()
    lows = [asyncio.ensure_future(one(engine, [(31 * i + j) % 30000 + 100 for j in range(args.low_prompt)],
                                      low_sp, 0)) for i in range(args.low)]
    highs = []
    for i in range(args.high):
        await asyncio.sleep(args.interval)
        ids = [(17 * i + 5 * j) % 30000 + 200 for j in range(args.high_prompt)]
        highs.append(asyncio.ensure_future(one(engine, ids, high_sp, 100)))
    high = await asyncio.gather(*highs)
    low = await asyncio.gather(*lows)
    total = time.perf_counter() - t0
    info = engine.get_server_info()
    return {"high_ttft_p50_s": pct([t for t, _ in high], 0.5), "high_ttft_p99_s": pct([t for t, _ in high], 0.99),
            "low_ttft_p50_s": pct([t for t, _ in low], 0.5), "low_e2e_p50_s": pct([e for _, e in low], 0.5),
            "total_s": round(total, 3), "retractions": info["num_retractions"],
            "preempted": info.get("priority", {}).get("preempted_total", {})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-running", type=int, default=4)
    ap.add_argument("--low", type=int, default=24)
    ap.add_argument("--low-prompt", type=int, default=64)
    ap.add_argument("--low-tokens", type=int, default=96)
    ap.add_argument("--high", type=int, default=12)
    ap.add_argument("--high-prompt", type=int, default=32)
    ap.add_argument("--high-tokens", type=int, default=8)
    ap.add_argument("--interval", type=float, default=0.25)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from radixlm import Engine

    results = {}
    for mode in args.modes.split(","):
        engine = Engine(model_path=args.model_path, dtype=args.dtype, max_running_requests=args.max_running,
                        **MODES[mode])
        try:
            engine.generate(input_ids=[100, 101, 102], sampling_params={"max_new_tokens": 2})  # warm-up
            results[mode] = asyncio.run(workload(engine, args))
        finally:
            engine.shutdown()
    emit({"workload": {k: getattr(args, k) for k in ("max_running", "low", "low_prompt", "low_tokens", "high",
                                                      "high_prompt", "high_tokens", "interval")},
          "modes": results}, args.out)


if __name__ == "__main__":
    main()
