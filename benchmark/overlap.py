"""Overlap scheduling on and off, in one run: throughput and the scheduler's cost per step.

    python benchmark/overlap.py [--num 64] [--prompt-len 24] [--output-len 64] [--model-path P] [--device cuda] [--quantization w8a8_int8] [--kv-cache-dtype int8] [--out F.json]

A decode-heavy workload of many small requests goes through the scheduler in-process
(no IPC, no tokenizer: what is measured is the scheduler + model), once with
--disable-overlap-schedule and once with --enable-overlap-schedule. Per mode:
  output_tok_per_s          end-to-end throughput of the workload
  step_ms                   mean wall time of one scheduler iteration
  forward_ms_per_step       model forward + sampling time per step, from each launch's span
                            (CUDA timing events on the forward stream; wall time on the CPU)
  scheduler_visible_ms_per_step   time the model waited between forwards (what the scheduler
                            costs that is NOT hidden; forward_idle_fraction is its share)
  scheduler_cpu_ms_per_step CPU time of the scheduler thread per step, the forward excluded
                            (receive, admission, batch building, result processing)
  scheduler_cpu_fraction    scheduler_cpu_ms_per_step / step_ms
Greedy outputs of the two modes are compared too (they must be identical).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import emit  # noqa: E402


def run_mode(overlap: bool, args) -> tuple[dict, dict[str, list[int]]]:
    from radixlm.config import ServerArgs
    from radixlm.messages import TokenizedGenerateReq
    from radixlm.sampling_params import SamplingParams
    from radixlm.srt.scheduler_process import build_scheduler

    outputs: dict[str, list[int]] = {}

    def collect(batch) -> None:  # BatchTokenOut of incremental ReqOutputs
        for o in batch.outputs:
            outputs.setdefault(o.rid, []).extend(o.new_token_ids)

    sargs = ServerArgs(model_path=args.model_path, device=args.device, dtype=args.dtype,
                       quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
                       disable_overlap_schedule=not overlap, enable_overlap_schedule=overlap)
    sched, runner = build_scheduler(sargs, collect)

    def submit(tag: str, n: int, out_len: int) -> None:
        for i in range(n):
            ids = [(17 * i + 31 * j) % 40000 + 100 for j in range(args.prompt_len)]
            sp = SamplingParams.from_dict({"max_new_tokens": out_len, "temperature": 0.0, "ignore_eos": True})
            sched.add_request(TokenizedGenerateReq(rid=f"{tag}{i}", input_ids=ids, sampling_params=sp))

    submit("warm", 4, 4)
    while sched.step():
        pass
    sched.flush_cache()
    outputs.clear()
    timer = sched.timer
    # CPU time this (scheduler) thread spends inside forwards: without overlap the forward
    # runs here, and its time must not count as scheduling.
    fwd_cpu = [0.0]
    launch = sched.worker._launch  # runs the forward on this thread when overlap is off

    def timed_launch(batch):
        c = time.thread_time()
        try:
            return launch(batch)
        finally:
            fwd_cpu[0] += time.thread_time() - c

    sched.worker._launch = timed_launch
    busy0, idle0, steps0 = timer.busy_s, timer.idle_s, sched.stats.num_steps
    submit("r", args.num, args.output_len)
    cpu0, t0 = time.thread_time(), time.perf_counter()
    while sched.step():
        pass
    sched.sync()
    wall, cpu = time.perf_counter() - t0, time.thread_time() - cpu0
    steps = sched.stats.num_steps - steps0
    busy, idle = timer.busy_s - busy0, timer.idle_s - idle0
    sched_cpu = cpu - (0.0 if overlap else fwd_cpu[0])
    res = {"overlap": overlap, "wall_s": round(wall, 3), "steps": steps,
           "output_tok_per_s": round(args.num * args.output_len / wall, 1),
           "step_ms": round(1000 * wall / steps, 3),
           "forward_ms_per_step": round(1000 * busy / steps, 3),
           "scheduler_visible_ms_per_step": round(1000 * idle / steps, 3),
           "forward_idle_fraction": round(idle / (busy + idle), 4) if busy + idle else 0.0,
           "scheduler_cpu_ms_per_step": round(1000 * sched_cpu / steps, 3),
           "scheduler_cpu_fraction": round(sched_cpu / wall, 4),
           "dtype": str(runner.dtype).replace("torch.", ""), "quantization": args.quantization,
           "kv_cache_dtype": runner.kv_pool.kv_cache_dtype, "device": runner.device,
           "attention_backend": runner.attention_backend_name}
    sched.worker.shutdown()
    return res, {k: v for k, v in outputs.items() if k.startswith("r")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=24)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default=None, choices=("w8a8_int8",))
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "int8"))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    off, out_off = run_mode(False, args)
    on, out_on = run_mode(True, args)
    same = sum(out_off.get(k) == v for k, v in out_on.items())
    emit({"workload": {"num_requests": args.num, "prompt_len": args.prompt_len, "output_len": args.output_len},
          "overlap_off": off, "overlap_on": on,
          "speedup_overlap": round(on["output_tok_per_s"] / off["output_tok_per_s"], 3),
          "identical_outputs": f"{same}/{len(out_off)}"}, args.out)


if __name__ == "__main__":
    main()
