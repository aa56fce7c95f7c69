"""Decode steps with the decoder layers as one native call (models/fused_decode.py) against the
Python layers, alternated step by step in one process (the scheduler and model runner without
IPC, as engine_steps.py), so that the host's drift between processes does not enter the ratio.
Prints JSON: median and p10 ms per decode step of each, over --rounds runs of N x output_len.

    python benchmark/micro/fused_decode_ab.py --num 32 [--quantization w8a8_int8 --kv-cache-dtype int8]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=40)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", default=None, choices=("w8a8_int8",))
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "int8"))
    args = ap.parse_args()
    from radixlm.config import ServerArgs
    from radixlm.messages import TokenizedGenerateReq
    from radixlm.sampling_params import SamplingParams
    from radixlm.srt.scheduler_process import build_scheduler

    sched, runner = build_scheduler(ServerArgs(model_path=None, dtype=args.dtype, quantization=args.quantization,
                                               kv_cache_dtype=args.kv_cache_dtype), lambda out: None)
    steps: dict[str, list[float]] = {"python_layers": [], "fused": []}

    def run(tag: str, n: int, out_len: int, record: bool) -> None:
        for i in range(n):
            ids = [(17 * i + 31 * j) % 40000 + 100 for j in range(args.prompt_len)]
            sp = SamplingParams.from_dict({"max_new_tokens": out_len, "temperature": 0.0, "ignore_eos": True})
            sched.add_request(TokenizedGenerateReq(rid=f"{tag}{i}", input_ids=ids, sampling_params=sp))
        k = 0
        while True:
            fused = k % 2 == 1
            os.environ["RADIXLM_FUSED_DECODE"] = "1" if fused else "0"  # read at every forward
            t0 = time.perf_counter()
            more = sched.step()
            dt = time.perf_counter() - t0
            if record and more and k >= 4:  # past the prefill steps
                steps["fused" if fused else "python_layers"].append(dt)
            k += 1
            if not more:
                break

    run("warm", 2, 4, False)
    sched.flush_cache()
    for r in range(args.rounds):
        run(f"r{r}_", args.num, args.output_len, True)
        sched.flush_cache()
    os.environ.pop("RADIXLM_FUSED_DECODE", None)
    res = {"num": args.num, "output_len": args.output_len, "dtype": str(runner.dtype),
           "quantization": args.quantization, "kv_cache_dtype": runner.kv_pool.kv_cache_dtype}
    for name, v in steps.items():
        v = sorted(v)
        res[name] = {"steps": len(v), "median_ms": round(statistics.median(v) * 1e3, 2),
                     "p10_ms": round(v[len(v) // 10] * 1e3, 2)}
    res["speedup"] = round(res["python_layers"]["median_ms"] / res["fused"]["median_ms"], 3)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
