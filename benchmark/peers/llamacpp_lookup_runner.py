"""llama.cpp prompt-lookup decoding peer of benchmark/speculative.py (llama-cpp-python's
high-level Llama with LlamaPromptLookupDecoding): runs in its own venv, never imports radixlm.

    <llamacpp-venv>/bin/python benchmark/peers/llamacpp_lookup_runner.py SPEC.json RESULT.json

SPEC: {"mode": "suite", "model": GGUF file, "workloads": {name: [[ids...], ...]}, "output_len": N,
       "single": S, "num_draft_tokens": K, "threads": T}
Per workload, the first S prompts one at a time, greedy (temp 0), exactly output_len tokens,
KV reset before each run, with and without the prompt-lookup draft model: decode ms/token =
(full - TTFT) / (output_len - 1), each the best of "repeats" (2) runs. The high-level API decodes one sequence, so there is no
batched speculative number for llama.cpp here.
"""
from __future__ import annotations

import statistics
import time

from peer_io import read_spec, write_result


def main() -> None:
    spec, out_path = read_spec()
    import llama_cpp as L
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    n = spec["output_len"]
    longest = max(len(p) for ps in spec["workloads"].values() for p in ps) + n
    n_ctx = -(-longest // 256) * 256 + 256
    common = {"model_path": spec["model"], "n_ctx": n_ctx, "n_threads": spec["threads"],
              "n_threads_batch": spec["threads"], "n_batch": 2048, "verbose": False}
    t0 = time.perf_counter()
    engines = {"off": L.Llama(**common),
               "on": L.Llama(**common, draft_model=LlamaPromptLookupDecoding(
                   max_ngram_size=2, num_pred_tokens=spec["num_draft_tokens"]))}
    load_s = time.perf_counter() - t0

    def run(llm, prompt: list[int], k: int) -> float:
        llm.reset()
        t = time.perf_counter()
        got = 0
        for _ in llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
            got += 1
            if got == k:
                break
        return time.perf_counter() - t

    for llm in engines.values():  # warm-up
        run(llm, spec["workloads"]["chat"][0][:16], 4)
    out = {"engine": "llama.cpp", "version": getattr(L, "__version__", None), "load_s": round(load_s, 2),
           "dtype": "Q4_1 (GGUF weights as shipped)", "threads": spec["threads"],
           "speculative": f"LlamaPromptLookupDecoding(max_ngram_size=2, num_pred_tokens={spec['num_draft_tokens']})",
           "batched_speculation": "not available in llama-cpp-python's high-level API (one sequence)"}
    for name, prompts in spec["workloads"].items():
        res = {}
        for mode, llm in engines.items():
            per = []
            for p in prompts[:spec["single"]]:
                # best of `repeats` for each: the first run of a long prompt pays one-time costs
                ttft = min(run(llm, p, 1) for _ in range(spec.get("repeats", 2)))
                full = min(run(llm, p, n) for _ in range(spec.get("repeats", 2)))
                per.append(1000 * (full - ttft) / (n - 1))
            res[mode] = {"single_decode_ms_per_token": round(statistics.median(per), 2),
                         "single_runs_ms_per_token": [round(x, 2) for x in per]}
        res["single_ms_per_token_ratio_on_over_off"] = round(res["on"]["single_decode_ms_per_token"]
                                                             / res["off"]["single_decode_ms_per_token"], 3)
        out[name] = res
    write_result(out, out_path)


if __name__ == "__main__":
    main()
