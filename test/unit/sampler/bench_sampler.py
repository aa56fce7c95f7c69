"""Timing printout (not a test): Sampler.sample for B=32, V=49152 on this machine.

    PYTHONPATH=. python test/unit/sampler/bench_sampler.py [threads]
"""
from __future__ import annotations

import random
import statistics
import sys
import time

import torch

from radixlm.sampling_params import SamplingParams
from radixlm.srt.model_runner.sampler import Sampler, SamplingRow

B, V = 32, 49152


def rows(prompt_len: int = 512, out_len: int = 128, logprob: bool = False, **kw) -> list[SamplingRow]:
    rng = random.Random(0)
    return [SamplingRow(SamplingParams.from_dict(dict(kw)), [rng.randrange(V) for _ in range(prompt_len)],
                        [rng.randrange(V) for _ in range(out_len)], frozenset({0}), logprob, 5 if logprob else 0)
            for _ in range(B)]


def bench(name: str, rs: list[SamplingRow], iters: int = 20, scale: float = 1.0) -> None:
    """scale multiplies randn logits: 1 is a flat worst case (top_p=0.9 spans ~35k tokens);
    4 is closer to a real LM (the top_p=0.9 nucleus is tens of tokens)."""
    s = Sampler(V)
    logits = torch.randn(B, V, generator=torch.Generator().manual_seed(0)) * scale
    s.sample(logits, rs)
    times, cpu = [], []
    for _ in range(iters):
        t, c = time.perf_counter(), time.process_time()
        s.sample(logits, rs)
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    # Median wall and median CPU time: the box is shared, so wall time includes waiting for
    # a core; with 1 thread, CPU time is the sampler's own cost.
    print(f"{name:<42} wall {statistics.median(times) * 1e3:7.2f} ms   "
          f"cpu {statistics.median(cpu) * 1e3:7.2f} ms   (fast path calls {s.stats.fast_path_calls})")


if __name__ == "__main__":
    # Threads default to 1: on a shared 2-core box, intra-op sync across busy cores adds noise.
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, B={B}, V={V}")
    bench("greedy (fast path)", rows(temperature=0.0))
    bench("greedy + logprobs(top 5)", rows(temperature=0.0, logprob=True))
    bench("greedy + rep/freq/presence penalties", rows(temperature=0.0, repetition_penalty=1.1,
                                                       frequency_penalty=0.2, presence_penalty=0.2))
    bench("random, temperature only", rows(temperature=0.8))
    bench("random, seeded rows", rows(temperature=0.8, seed=1))
    bench("random, top_k=50", rows(temperature=0.8, top_k=50))
    bench("random, top_p=0.9 (peaked logits)", rows(temperature=0.8, top_p=0.9), scale=4.0)
    bench("random, top_p=0.9 (flat: full sort)", rows(temperature=0.8, top_p=0.9))
    bench("random, min_p=0.05", rows(temperature=0.8, min_p=0.05))
    bench("random, top_k+top_p+min_p+penalties", rows(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05,
                                                      repetition_penalty=1.1, presence_penalty=0.3),
          scale=4.0)
