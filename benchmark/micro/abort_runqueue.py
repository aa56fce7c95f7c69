"""Where a slow Engine abort answer waits: per abort, the answer time and how long the engine's
loop thread and the caller's thread sat runnable without a CPU meanwhile (Linux schedstat).

    python benchmark/micro/abort_runqueue.py [NICE] [--rows FILE]   # the scheduler's niceness, default 19

--rows writes every abort (CLOCK_MONOTONIC times, the threads' ids) for sched_trace.py, which
says who held the CPUs while a slow answer's caller waited (under `perf record -k CLOCK_MONOTONIC`).

8 streams decode (overlap off); 300 times at 0.1-0.3 s, a live one is aborted from the caller's
asyncio loop and replaced. Prints the 12 slowest answers and the medians (docs/cancel_chain.md
§ Latency has a run).
"""
import argparse
import asyncio
import json
import os
import random
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmark.abort_latency import caller_thread  # noqa: E402 - after the path set-up above
from radixlm import Engine  # noqa: E402

def rq(tid: int) -> tuple[float, float]:
    """(ms waited runnable, ms run) of a thread of this process, since it started."""
    with open(f"/proc/self/task/{tid}/schedstat") as f:
        run, wait, _ = f.read().split()
    return int(wait) / 1e6, int(run) / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("nice", nargs="?", type=int, default=19)
    ap.add_argument("--rows", help="write every abort here (JSON)")
    ap.add_argument("--policy", default="normal", help="--scheduler-policy (normal, idle)")
    ap.add_argument("--loop", default="", help="override the engine's loop thread's policy: batch, normal, fifo or nice:N")
    ap.add_argument("--caller", default="", help="the caller's thread's policy: fifo (SCHED_FIFO 1) or normal")
    args = ap.parse_args()
    nice = args.nice
    params = {"max_new_tokens": 2000, "temperature": 0, "ignore_eos": True}
    with Engine(disable_overlap_schedule=True, scheduler_nice=nice, scheduler_policy=args.policy) as eng:
        vocab = eng.tokenizer_manager.vocab_size
        loop_tid = eng._thread.native_id  # the engine's loop thread
        me = threading.get_native_id()
        if args.caller:
            caller_thread(args.caller)
        if args.loop == "fifo":
            os.sched_setscheduler(loop_tid, os.SCHED_FIFO, os.sched_param(1))
        elif args.loop in ("batch", "normal"):
            os.sched_setscheduler(loop_tid, os.SCHED_BATCH if args.loop == "batch" else os.SCHED_OTHER,
                                  os.sched_param(0))
        elif args.loop.startswith("nice:"):
            os.setpriority(os.PRIO_PROCESS, loop_tid, int(args.loop[5:]))
        rng = random.Random(1)
        clock_offset = time.perf_counter() - time.monotonic()  # rows' times in CLOCK_MONOTONIC (perf -k)

        def prompt(r: random.Random) -> list[int]:
            return [r.randrange(3, vocab - 1) for _ in range(r.randrange(16, 48))]
        eng.generate(input_ids=prompt(rng), sampling_params={"max_new_tokens": 2})
        rows: list[dict] = []
        live: dict[str, bool] = {}
        t0: dict[str, float] = {}
        pending: dict[str, tuple] = {}

        async def consume(rid: str) -> None:
            stream = await eng.async_generate(input_ids=prompt(random.Random(rid)), sampling_params=params,
                                              rid=rid, stream=True)
            async for ch in stream:
                live[rid] = True
                if ch["meta_info"]["finish_reason"] is not None and rid in t0:
                    now = time.perf_counter()
                    (w1, r1), (c1, cr1) = rq(loop_tid), rq(me)
                    w0, r0, c0, cr0, call_ms = pending.pop(rid)
                    rows.append({"t_abort": t0[rid] - clock_offset, "t_answer": now - clock_offset,
                                 "answer_ms": (now - t0[rid]) * 1e3, "abort_call_ms": call_ms,
                                 "loop_wait_ms": w1 - w0, "loop_run_ms": r1 - r0,
                                 "caller_wait_ms": c1 - c0, "caller_run_ms": cr1 - cr0})
            live.pop(rid, None)

        async def go() -> None:
            tasks = []

            def launch(i: int) -> None:
                rid = f"x{i}"
                live[rid] = False
                tasks.append(asyncio.ensure_future(consume(rid)))
            for i in range(8):
                launch(i)
            for k in range(300):
                await asyncio.sleep(rng.uniform(0.1, 0.3))
                ready = [r for r, started in live.items() if started and r not in t0]
                if not ready:
                    continue
                rid = rng.choice(ready)
                (w0, r0), (c0, cr0) = rq(loop_tid), rq(me)
                t0[rid] = time.perf_counter()
                eng.abort_request(rid)
                pending[rid] = (w0, r0, c0, cr0, (time.perf_counter() - t0[rid]) * 1e3)
                launch(8 + k)
            eng.abort_request(abort_all=True)
            await asyncio.gather(*tasks)
        asyncio.run(go())
    rows.sort(key=lambda r: -r["answer_ms"])
    if args.rows:
        with open(args.rows, "w") as f:
            json.dump({"pid": os.getpid(), "caller_tid": me, "loop_tid": loop_tid, "rows": rows}, f)
    ms = [k for k in rows[0] if k.endswith("_ms")]
    print(json.dumps({"scheduler_nice": nice, "scheduler_policy": args.policy, "loop": args.loop, "n": len(rows),
                      "slowest": [{k: round(r[k], 2) for k in ms} for r in rows[:12]],
                      "median": {k: round(sorted(r[k] for r in rows)[len(rows) // 2], 3) for k in ms}},
                     indent=1))


if __name__ == "__main__":
    main()
