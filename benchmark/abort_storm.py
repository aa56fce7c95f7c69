"""Stop-path costs through the Engine; prints one JSON object.

    python benchmark/abort_storm.py [--model-path DIR] [--num-requests 64] [--output-len 64]

Measures:
- cancel latency (abort call -> the request's KV returned in the scheduler), p50/p99;
- output throughput of a batch with no aborts, and with a steady abort rate;
- retraction cost: the same workload on an ample and on a deliberately small KV pool.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time


def _prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab - 1) for _ in range(rng.randrange(16, 64))] for _ in range(n)]


async def _run(engine, prompts, output_len: int, abort_every_s: float | None) -> dict:
    params = {"max_new_tokens": output_len, "temperature": 0}
    rids = [f"b{time.monotonic_ns()}_{i}" for i in range(len(prompts))]
    t0 = time.perf_counter()
    tasks = [asyncio.ensure_future(engine.async_generate(input_ids=p, sampling_params=params, rid=r))
             for p, r in zip(prompts, rids)]
    aborted = 0
    if abort_every_s:
        rng = random.Random(1)
        while not all(t.done() for t in tasks):
            await asyncio.sleep(abort_every_s)
            engine.abort_request(rng.choice(rids))
            aborted += 1
    outs = await asyncio.gather(*tasks)
    wall = time.perf_counter() - t0
    tokens = sum(len(o["output_ids"]) for o in outs)
    return {"wall_s": round(wall, 3), "output_tokens": tokens, "output_tok_per_s": round(tokens / wall, 1),
            "abort_calls": aborted,
            "aborted_requests": sum(o["meta_info"]["finish_reason"]["type"] == "abort" for o in outs),
            "retractions": sum(o["meta_info"]["num_retractions"] for o in outs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--abort-interval", type=float, default=0.05, help="seconds between aborts")
    ap.add_argument("--small-pool", type=int, default=1500, help="KV tokens for the retraction run")
    args = ap.parse_args()

    from radixlm import Engine

    result: dict = {"workload": vars(args)}
    with Engine(model_path=args.model_path, dtype=args.dtype) as engine:
        vocab = engine.tokenizer_manager.vocab_size
        prompts = _prompts(args.num_requests, vocab)
        engine.generate(input_ids=prompts[0], sampling_params={"max_new_tokens": 2})  # warm-up
        engine.flush_cache()
        result["no_aborts"] = asyncio.run(_run(engine, prompts, args.output_len, None))
        engine.flush_cache()
        result["steady_aborts"] = asyncio.run(_run(engine, prompts, args.output_len, args.abort_interval))
        lat = engine.get_server_info()["cancel_latency_s"]
        result["cancel_latency_ms"] = {"count": lat["count"],
                                       "p50": None if lat["p50"] is None else round(lat["p50"] * 1e3, 2),
                                       "p99": None if lat["p99"] is None else round(lat["p99"] * 1e3, 2)}
    with Engine(model_path=args.model_path, dtype=args.dtype, max_total_tokens=args.small_pool) as small:
        small.generate(input_ids=prompts[0], sampling_params={"max_new_tokens": 2})
        small.flush_cache()
        run = asyncio.run(_run(small, prompts, args.output_len, None))
        base = result["no_aborts"]["output_tok_per_s"]
        run["throughput_vs_ample_pool"] = round(run["output_tok_per_s"] / base, 3) if base else None
        result["small_pool_retraction"] = run
    json.dump(result, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
