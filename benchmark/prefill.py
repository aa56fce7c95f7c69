"""Prefill: prompt tokens/s and time to first token for long prompts; prints one JSON object.

    python benchmark/prefill.py [--quantization w8a8_int8] [--kv-cache-dtype int8] [--repeats 3] [--peer vllm,llamacpp | --interleave R] [--out F.json]

Three cases, each on distinct random token ids (no prefix is shared, so nothing is cached):
  single_2k      one 2,048-token prompt
  single_8k      one 8,000-token prompt (8k less room for the output: the default model's
                 context is 8,192)
  concurrent_8x2k  eight 2,048-token prompts submitted at once
--interleave R (vllm only) keeps radixlm and vLLM loaded side by side and runs each case R times
each, taking turns (peer_rounds.py); every case is then an offline batch of 1-token requests, and
speedup_vs_vllm is the median of the R paired ratios of wall times, so the machine's drift does
not decide it.

Without it, the single cases are latency runs (benchmark/latency.py's method: TTFT = the wall time of a
1-token request, median of --repeats, cache flushed before each); the concurrent case is an
offline batch of 1-token requests, whose wall time is the last prompt's TTFT. prompt_tok_per_s
= prompt tokens / that time. Each peer runs the same token ids in its own venv (vllm: bf16,
prefix caching on but reset before each run; llamacpp: Q4_1, n_batch 2048), and
speedup_vs_<peer> is its time over ours.
"""
from __future__ import annotations

import argparse
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import add_peer_args, emit, parse_peers, run_engine_peer  # noqa: E402
from latency import run_radixlm as run_radixlm_latency  # noqa: E402
from offline_throughput import run_radixlm as run_radixlm_batch  # noqa: E402

CASES = {"single_2k": (1, 2048), "single_8k": (1, 8000), "concurrent_8x2k": (8, 2048)}


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    lo, hi = min(1000, vocab // 4), max(vocab - 1000, vocab * 3 // 4)  # away from the special ids
    return [[rng.randrange(lo, hi) for _ in range(length)] for _ in range(n)]


def figures(prompts: list[list[int]], seconds: float) -> dict:
    return {"prompts": len(prompts), "prompt_tokens": sum(map(len, prompts)), "ttft_s": round(seconds, 4),
            "prompt_tok_per_s": round(sum(map(len, prompts)) / seconds, 1)}


def run_ours(prompts: list[list[int]], args, model_path: str) -> dict:
    kw = {"model_path": model_path, "dtype": args.dtype, "quantization": args.quantization,
          "kv_cache_dtype": args.kv_cache_dtype}
    if len(prompts) == 1:
        r = run_radixlm_latency(prompts[0], 2, args.repeats, model_path, args.dtype, args.quantization,
                                args.kv_cache_dtype)
        return {**figures(prompts, r["ttft_s"]), "ttft_runs_s": r["ttft_runs_s"], "dtype": r["dtype"],
                "quantization": r.get("quantization"), "kv_cache_dtype": r.get("kv_cache_dtype")}
    r = run_radixlm_batch(prompts, 1, kw, args.repeats)
    return {**figures(prompts, r["wall_s"]), "runs_wall_s": r["runs_wall_s"],
            "dtype": r["dtype"], "quantization": r.get("quantization"), "kv_cache_dtype": r.get("kv_cache_dtype")}


def run_peer(peer: str, prompts: list[list[int]], args, model_path: str) -> dict:
    if len(prompts) == 1:
        spec = {"mode": "latency", "prompt": prompts[0], "output_len": 2, "repeats": args.repeats, "max_num_seqs": 1}
        out = run_engine_peer(peer, spec, model_path, args)
        return {**figures(prompts, out["ttft_s"]), "ttft_runs_s": out.get("ttft_runs_s")} if "ttft_s" in out else out
    spec = {"mode": "generate", "prompts": prompts, "output_len": 1, "max_num_seqs": len(prompts)}
    out = run_engine_peer(peer, spec, model_path, args)
    return figures(prompts, out["wall_s"]) if "wall_s" in out else out


def run_interleaved_case(prompts: list[list[int]], args, model_path: str) -> dict:
    from offline_throughput import run_interleaved
    kw = {"model_path": model_path, "dtype": args.dtype, "quantization": args.quantization,
          "kv_cache_dtype": args.kv_cache_dtype}
    raw: dict = {}
    run_interleaved(prompts, 1, kw, argparse.Namespace(**vars(args), max_num_seqs=len(prompts)), model_path, raw)
    case: dict = {"interleaved": {"rounds": args.interleave, "pause_s": args.round_pause}}
    for name in ("radixlm", "vllm"):
        r = raw.get(name, {})
        if "runs_wall_s" not in r:
            case[name] = r  # the peer's error entry
            continue
        walls = r["runs_wall_s"]
        case[name] = {**figures(prompts, sorted(walls)[len(walls) // 2]), "runs_wall_s": walls,
                      "runs_idle_engines_cpu_s": r.get("runs_idle_engines_cpu_s"),
                      **{k: r[k] for k in ("dtype", "quantization", "kv_cache_dtype", "version") if k in r}}
    if "speedup_vs_vllm" in raw:
        case["speedup_vs_vllm"] = raw["speedup_vs_vllm"]
        case["paired_speedup_vs_vllm"] = raw["paired_speedup_vs_vllm"]
    return case


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {', '.join(CASES)}")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default=None, choices=("w8a8_int8",))
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "int8"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    add_peer_args(ap, ("vllm", "llamacpp"))
    ap.add_argument("--interleave", type=int, default=0, metavar="R",
                    help="R rounds of radixlm and vLLM taking turns, both loaded (implies --peer vllm)")
    ap.add_argument("--round-pause", type=float, default=2.0, help="seconds of rest before each interleaved run")
    args = ap.parse_args()
    peers = parse_peers(ap, args.peer, ("vllm", "llamacpp"))
    if args.interleave and any(p != "vllm" for p in peers):
        ap.error("--interleave runs radixlm against vllm only")
    from radixlm.srt.weights.loader import load_model_config, resolve_model_path
    model_path = resolve_model_path(args.model_path)
    vocab = load_model_config(model_path).vocab_size
    result: dict = {"benchmark": "prefill", "model": model_path, "repeats": args.repeats}
    for i, name in enumerate(c.strip() for c in args.cases.split(",") if c.strip()):
        n, length = CASES[name]
        prompts = random_prompts(n, length, vocab, args.seed + i)
        if args.interleave:
            result[name] = run_interleaved_case(prompts, args, model_path)
            print(f"{name}: {result[name]}", file=sys.stderr)
            continue
        case = {"radixlm": run_ours(prompts, args, model_path)}
        for peer in peers:
            case[peer] = run_peer(peer, prompts, args, model_path)
            if case[peer].get("ttft_s"):
                case[f"speedup_vs_{peer}"] = round(case[peer]["ttft_s"] / case["radixlm"]["ttft_s"], 2)
        result[name] = case
        print(f"{name}: {case}", file=sys.stderr)
    emit(result, args.out)


if __name__ == "__main__":
    main()
