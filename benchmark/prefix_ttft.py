"""TTFT of a prompt whose long prefix is in the radix cache vs the same prompt uncached.

    python benchmark/prefix_ttft.py [--prefix-len 600] [--suffix-len 8] [--repeats 7] [--out F.json]

Uncached: the radix cache is flushed, then prefix + suffix is prefilled whole. Cached: the
prefix was computed by an earlier request (radix hit), only the new suffix is prefilled.
TTFT = wall time of a request with max_new_tokens=1 through the in-process Engine (prefill +
first token + the engine's round trip). Medians over --repeats; the target is
cached <= uncached / 10.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import emit  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefix-len", type=int, default=600)
    ap.add_argument("--suffix-len", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from radixlm import Engine

    engine = Engine(model_path=args.model_path, dtype=args.dtype)
    prefix = [(37 * j) % 30000 + 200 for j in range(args.prefix_len)]
    one = {"max_new_tokens": 1, "temperature": 0.0, "ignore_eos": True}

    def suffix(i: int) -> list[int]:
        return [(101 * i + 7 * j) % 30000 + 300 for j in range(args.suffix_len)]

    def ttft(ids: list[int]) -> tuple[float, int]:
        t0 = time.perf_counter()
        out = engine.generate(input_ids=ids, sampling_params=one)
        return time.perf_counter() - t0, out["meta_info"].get("cached_tokens", 0)

    ttft(prefix + suffix(0))  # warm-up
    uncached, cached, hits = [], [], []
    for i in range(1, args.repeats + 1):
        engine.flush_cache()
        uncached.append(ttft(prefix + suffix(i))[0])
        t, hit = ttft(prefix + suffix(1000 + i))  # a new suffix after the now-cached prefix
        cached.append(t)
        hits.append(hit)
    info = engine.get_server_info()
    engine.shutdown()
    u, c = statistics.median(uncached), statistics.median(cached)
    emit({"workload": {"prefix_len": args.prefix_len, "suffix_len": args.suffix_len, "repeats": args.repeats},
          "dtype": info.get("dtype"), "ttft_uncached_s": round(u, 4), "ttft_cached_s": round(c, 4),
          "cached_over_uncached": round(c / u, 3), "cached_tokens": hits,
          "uncached_runs_s": [round(x, 4) for x in uncached], "cached_runs_s": [round(x, 4) for x in cached]},
         args.out)


if __name__ == "__main__":
    main()
