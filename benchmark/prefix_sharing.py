"""Prefix sharing: N requests that share a long prefix (a 609-token system prompt), each with
its own short question, greedy, EOS ignored; prints one JSON object.

    python benchmark/prefix_sharing.py --num-requests 32 --prefix-len 609 --output-len 32 [--kv-cache-dtype int8] [--peer hf,vllm,llamacpp]

radixlm computes the prefix once (radix cache) and its decode attends to the shared KV
once per step. The peers, on the same token ids:
  hf        no prefix cache: it prefills every full prompt (batched, float32)
  vllm      vLLM-CPU with automatic prefix caching on (cold at the start of the measured run)
  llamacpp  llama.cpp: the prefix is prefilled once and its KV cells shared by all sequences
            (llama_memory_seq_cp on a unified KV cache), then --max-num-seqs per decode step
Throughput is output tokens over the wall time of the whole batch, prefill included.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import add_peer_args, agreement, emit, parse_peers  # noqa: E402
from offline_throughput import TOPICS, run_hf, run_peers, run_radixlm  # noqa: E402

SYSTEM = ("You are a careful assistant for a public library. Answer questions about history, "
          "science and geography in plain language, cite well-known facts only, and keep every answer "
          "short. ")


def make_prompts(tokenizer, n: int, prefix_len: int) -> tuple[list[list[int]], int]:
    """n prompts whose first prefix_len token ids are identical."""
    text = SYSTEM
    while len(tokenizer.encode(text)) < prefix_len + 16:
        text += " ".join(f"Topic {i}: {t}." for i, t in enumerate(TOPICS)) + " "
    prefix = tokenizer.encode(text)[:prefix_len]
    out = []
    for i in range(n):
        q = tokenizer.encode(f"\nQuestion {i}: tell me about {TOPICS[i % len(TOPICS)]}.\nAnswer:")
        out.append(prefix + q)
    return out, len(prefix)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--prefix-len", type=int, default=609)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default=None, choices=("w8a8_int8",), help="radixlm weight/activation quantization")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "int8"), help="radixlm KV cache storage (int8: per token and head scales)")
    add_peer_args(ap)
    ap.add_argument("--hf-batch-size", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=32, help="sequences per decode step of the vllm/llamacpp peers")
    ap.add_argument("--repeats", type=int, default=1, help="radixlm runs of the workload; the median is reported")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    peers = parse_peers(ap, args.peer)
    from radixlm.srt.weights.loader import load_tokenizer, resolve_model_path
    model_path = resolve_model_path(args.model_path)
    prompts, plen = make_prompts(load_tokenizer(model_path), args.num_requests, args.prefix_len)
    result = {"workload": {"num_requests": len(prompts), "shared_prefix_tokens": plen,
                           "input_tokens": sum(map(len, prompts)), "output_len": args.output_len,
                           "model": model_path}}
    ours = run_radixlm(prompts, args.output_len, {"model_path": model_path, "dtype": args.dtype,
                                                    "quantization": args.quantization,
                                                    "kv_cache_dtype": args.kv_cache_dtype}, args.repeats)
    our_outputs = ours.pop("outputs")
    result["radixlm"] = ours
    if "hf" in peers:
        result["hf"] = {**run_hf(prompts, args.output_len, model_path, args.hf_batch_size), "prefix_cache": False}
        hf_out = result["hf"].pop("outputs")
        result["speedup_vs_hf"] = round(ours["output_tok_per_s"] / result["hf"]["output_tok_per_s"], 2)
        result["hf"]["agreement_with_radixlm"] = agree = agreement(our_outputs, hf_out)
        result["mean_common_prefix_tokens"] = agree["mean_common_prefix_tokens"]
    run_peers(peers, args, model_path, prompts, args.output_len, our_outputs, ours, result, shared_prefix_len=plen)
    emit(result, args.out)


if __name__ == "__main__":
    main()
