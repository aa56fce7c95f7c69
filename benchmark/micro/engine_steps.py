"""Profile the scheduler + model runner in one process (no IPC, no tokenizer/detokenizer).

    python benchmark/micro/engine_steps.py --num 32 --prompt-len 40 --output-len 64 [--quantization w8a8_int8] [--kv-cache-dtype int8] [--profile]

Reports the mean wall time per decode step and, with --profile, a cProfile of the whole run
sorted by cumulative time, to separate model time from per-step Python in the runner and
scheduler.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=40)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default=None, choices=("w8a8_int8",))
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "int8"))
    ap.add_argument("--shared-prefix", type=int, default=0, help="leading ids common to all prompts")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--torch-profile", action="store_true", help="op-level table instead of cProfile")
    args = ap.parse_args()
    from radixlm.config import ServerArgs
    from radixlm.messages import TokenizedGenerateReq
    from radixlm.sampling_params import SamplingParams
    from radixlm.srt.scheduler_process import build_scheduler

    sched, runner = build_scheduler(ServerArgs(model_path=None, dtype=args.dtype, quantization=args.quantization,
                                               kv_cache_dtype=args.kv_cache_dtype), lambda out: None)

    def run(tag: str, n: int, out_len: int) -> float:
        for i in range(n):
            ids = [(31 * j) % 40000 + 100 for j in range(args.shared_prefix)]
            ids += [(17 * i + 31 * j) % 40000 + 100 for j in range(args.prompt_len)]
            sp = SamplingParams.from_dict({"max_new_tokens": out_len, "temperature": 0.0, "ignore_eos": True})
            sched.add_request(TokenizedGenerateReq(rid=f"{tag}{i}", input_ids=ids, sampling_params=sp))
        t0 = time.perf_counter()
        while sched.step():
            pass
        return time.perf_counter() - t0

    run("warm", 2, 4)
    sched.flush_cache()
    prof = cProfile.Profile() if args.profile else None
    if prof:
        prof.enable()
    if args.torch_profile:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU]) as tprof:
            wall = run("r", args.num, args.output_len)
        print(tprof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22))
    else:
        wall = run("r", args.num, args.output_len)
    if prof:
        prof.disable()
    print({"num": args.num, "output_len": args.output_len, "wall_s": round(wall, 3),
           "output_tok_per_s": round(args.num * args.output_len / wall, 1), "dtype": str(runner.dtype),
           "quantization": args.quantization, "kv_cache_dtype": runner.kv_pool.kv_cache_dtype})
    if prof:
        pstats.Stats(prof).sort_stats("cumulative").print_stats(35)


if __name__ == "__main__":
    main()
