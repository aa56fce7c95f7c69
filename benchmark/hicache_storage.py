"""HiCache's storage tier shared by two workers; prints one JSON object.

    python benchmark/hicache_storage.py [--model-path DIR] [--conversations 32] [--turns 3]
        [--user-len 200] [--output-len 16] [--prefetch-policy wait_complete]

Two Engines (two workers) in one process serve multi-turn conversations; turn t of
conversation c goes to worker (c + t) % 2, so every turn lands on the worker that did not see
the previous one (a router with no affinity). The workload runs twice: HiCache on both workers
without storage, then with one `file` storage directory shared by both. For each: cache-hit
ratio of the prompts, TTFT (time to the first streamed token), prompt tokens computed, the
storage counters, and whether the greedy outputs of the two runs are identical.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time


async def _one(engine, prompt: list[int], output_len: int) -> tuple[list[int], float, dict]:
    params = {"max_new_tokens": output_len, "temperature": 0, "ignore_eos": True}
    t0 = time.perf_counter()
    ttft = None
    ids: list[int] = []
    meta: dict = {}
    async for chunk in await engine.async_generate(input_ids=prompt, sampling_params=params, stream=True):
        if ttft is None and chunk["output_ids"]:
            ttft = time.perf_counter() - t0
        ids.extend(chunk["output_ids"])
        meta = chunk["meta_info"]
    return ids, ttft if ttft is not None else time.perf_counter() - t0, meta


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * q))]


def run(args, storage_dir: str | None, messages: list[list[list[int]]]) -> tuple[dict, list[list[int]]]:
    from radixlm import Engine

    kw = dict(model_path=args.model_path, dtype=args.dtype, max_total_tokens=args.device_tokens,
              enable_hierarchical_cache=True)
    if storage_dir is not None:
        kw.update(hicache_storage_backend="file", hicache_storage_dir=storage_dir,
                  hicache_storage_prefetch_policy=args.prefetch_policy,
                  hicache_storage_prefetch_threshold=args.prefetch_threshold)
    workers = [Engine(**kw), Engine(**kw)]
    try:
        history: list[list[int]] = [[] for _ in messages[0]]
        outputs, ttfts = [], []
        prompt_tokens = cached = 0

        async def drive() -> None:
            nonlocal prompt_tokens, cached
            for t, turn in enumerate(messages):
                for c, msg in enumerate(turn):
                    prompt = history[c] + msg
                    ids, ttft, meta = await _one(workers[(c + t) % 2], prompt, args.output_len)
                    history[c] = prompt + ids
                    outputs.append(ids)
                    ttfts.append(ttft)
                    prompt_tokens += meta.get("prompt_tokens", len(prompt))
                    cached += meta.get("cached_tokens", 0)

        t0 = time.perf_counter()
        asyncio.run(drive())
        wall = time.perf_counter() - t0
        infos = [w.get_server_info() for w in workers]
    finally:
        for w in workers:
            w.shutdown()
    result = {
        "storage": storage_dir is not None,
        "requests": len(outputs),
        "prompt_tokens": prompt_tokens,
        "prompt_tokens_computed": sum(i.get("num_prefill_tokens") or 0 for i in infos),
        "cache_hit_rate": round(cached / max(prompt_tokens, 1), 4),
        "ttft_mean_s": round(statistics.fmean(ttfts), 4),
        "ttft_p50_s": round(_pct(ttfts, 0.5), 4),
        "ttft_p99_s": round(_pct(ttfts, 0.99), 4),
        "wall_s": round(wall, 3),
    }
    if storage_dir is not None:
        result["storage_stats"] = [i["hicache"]["storage"] for i in infos]
    return result, outputs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device-tokens", type=int, default=8192, help="device KV pool of each worker (tokens)")
    ap.add_argument("--conversations", type=int, default=32)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--user-len", type=int, default=200)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--prefetch-policy", default="wait_complete", choices=("best_effort", "wait_complete", "timeout"))
    ap.add_argument("--prefetch-threshold", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=49152, help="token ids are drawn below this")
    args = ap.parse_args()

    rng = random.Random(0)
    messages = [[[rng.randrange(3, args.vocab - 1) for _ in range(args.user_len)] for _ in range(args.conversations)]
                for _ in range(args.turns)]
    off, out_off = run(args, None, messages)
    with tempfile.TemporaryDirectory(prefix="radixlm-kv-") as d:
        on, out_on = run(args, d, messages)
    print(json.dumps({"workload": vars(args), "without_storage": off, "with_storage": on,
                      "outputs_identical": out_off == out_on,
                      "outputs_agreeing": f"{sum(a == b for a, b in zip(out_off, out_on))}/{len(out_on)}"},
                     indent=2))


if __name__ == "__main__":
    main()
