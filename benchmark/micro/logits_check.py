"""Logits of a mode (dtype, --quantization, --kv-cache-dtype) vs float32 on real prompts.

    python benchmark/micro/logits_check.py                                   # bf16 vs float32
    python benchmark/micro/logits_check.py --dtype float32 --kv-cache-dtype int8   # int8 KV alone
    python benchmark/micro/logits_check.py --quantization w8a8_int8 --kv-cache-dtype int8 [--backend cpu]

Runs the default model through the engine's own model code (no scheduler): the float32
reference (model-dtype KV cache, no quantization, torch_native) prefills each chat prompt
and then decodes --decode-steps tokens greedily; the mode prefills the same prompt and
decodes the reference's tokens (teacher forcing), so both see the same sequence and every
position is compared: the largest logit difference relative to the float32 logit range,
top-1 agreement, top-5 overlap and KL(reference || mode). The decode positions matter for
an int8 KV cache: each step attends over every stored (quantized) key and value.
With --kv-cache-dtype int8 the same mode with the model-dtype KV cache is measured too
("kv_auto_baseline"), so the int8 cache's own share of the difference shows.
"""
from __future__ import annotations

import argparse
import json

import torch


def run(dtype_name: str, prompts: list[list[int]], steps: int, backend: str = "torch_native",
        quantization: str | None = None, kv_cache_dtype: str = "auto",
        forced: list[list[int]] | None = None) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Per prompt: float32 logits [1 + steps, vocab] (the prompt's last position, then each
    decode step) and the tokens fed to the decode steps (greedy, or `forced`)."""
    from decode_step import build  # same directory
    from radixlm.srt.model_runner.forward_batch import ForwardBatch, ForwardMode
    ctx = max(map(len, prompts)) + steps + 1
    model, attn, _, _ = build(dtype_name, 1, ctx, backend=backend, quantization=quantization,
                              kv_cache_dtype=kv_cache_dtype)
    table = torch.arange(1, ctx + 1, dtype=torch.int64)[None]  # position t in slot t + 1
    all_logits, all_tokens = [], []
    with torch.inference_mode():
        for p, ids in enumerate(prompts):
            n = len(ids)
            fb = ForwardBatch.build(ForwardMode.EXTEND, ids, table[0, :n], [0], [0], [n], table)
            attn.init_forward_metadata(fb)
            logits = [model.compute_logits(model.forward(fb, attn)[-1:])[0].float()]
            tokens: list[int] = []
            for j in range(steps):
                tok = forced[p][j] if forced is not None else int(logits[-1].argmax())
                tokens.append(tok)
                if j == steps - 1:
                    break  # the last fed token's logits are not compared
                pos = n + j
                fb = ForwardBatch.build(ForwardMode.DECODE, [tok], table[0, pos:pos + 1], [0], [pos], [1], table)
                attn.init_forward_metadata(fb)
                logits.append(model.compute_logits(model.forward(fb, attn))[0].float())
            all_logits.append(torch.stack(logits))
            all_tokens.append(tokens)
    return all_logits, all_tokens


def compare(ref: torch.Tensor, got: torch.Tensor) -> dict:
    """ref, got: [positions, vocab] -> figures of the prefill position and over all positions."""
    ref, got = ref.double(), got.double()
    diff = (ref - got).abs().amax(-1)
    rel = diff / (ref.amax(-1) - ref.amin(-1))
    top1 = ref.argmax(-1) == got.argmax(-1)
    lp_ref, lp_got = ref.log_softmax(-1), got.log_softmax(-1)
    kl = (lp_ref.exp() * (lp_ref - lp_got)).sum(-1)  # KL(reference || mode), nats
    top5 = [len(set(a.tolist()) & set(b.tolist())) for a, b in zip(ref.topk(5).indices, got.topk(5).indices)]
    return {"prefill": {"max_abs_diff": round(diff[0].item(), 4), "rel_to_range": round(rel[0].item(), 5),
                        "top1_equal": bool(top1[0]), "top5_overlap": top5[0], "kl": round(kl[0].item(), 6)},
            "all_positions": {"positions": int(ref.shape[0]), "top1_agreement": round(top1.double().mean().item(), 4),
                              "mean_top5_overlap": round(sum(top5) / len(top5), 3),
                              "max_rel_to_range": round(rel.max().item(), 5),
                              "mean_kl": round(kl.mean().item(), 6), "max_kl": round(kl.max().item(), 6)}}


def summarize(rows: list[dict]) -> dict:
    pos = sum(r["all_positions"]["positions"] for r in rows)
    return {"positions": pos,
            "top1_agreement": round(sum(r["all_positions"]["top1_agreement"] * r["all_positions"]["positions"]
                                        for r in rows) / pos, 4),
            "mean_kl": round(sum(r["all_positions"]["mean_kl"] * r["all_positions"]["positions"] for r in rows) / pos, 6),
            "max_kl": max(r["all_positions"]["max_kl"] for r in rows),
            "max_rel_to_range": max(r["all_positions"]["max_rel_to_range"] for r in rows),
            "prefill_top1_agreement": round(sum(r["prefill"]["top1_equal"] for r in rows) / len(rows), 4)}


CHECK_TEXTS = ["What is the capital of France?", "Explain photosynthesis to a child.",
               "Write a short essay about the Silk Road.", "List five facts about volcanoes."]


def check(dtype: str, quantization: str | None = None, kv_cache_dtype: str = "auto", backend: str = "torch_native",
          decode_steps: int = 32, kv_baseline: bool = True) -> dict:
    """The mode's logits against float32 on the chat prompts of CHECK_TEXTS (what main prints;
    also called by the throughput benchmarks so that each mode's quality sits next to its
    speed in the results JSON)."""
    from radixlm.srt.weights.loader import load_tokenizer, resolve_model_path
    tok = load_tokenizer(resolve_model_path(None))
    prompts = []
    for t in CHECK_TEXTS:
        ids = tok.apply_chat_template([{"role": "user", "content": t}], tokenize=True, add_generation_prompt=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    steps = max(1, decode_steps)
    ref, tokens = run("float32", prompts, steps)

    def measure(kv: str) -> dict:
        got, _ = run(dtype, prompts, steps, backend, quantization, kv, forced=tokens)
        rows = [compare(r, g) for r, g in zip(ref, got)]
        return {"summary": summarize(rows), "per_prompt": rows}

    mode = {"dtype": dtype, "quantization": quantization, "kv_cache_dtype": kv_cache_dtype,
            "attention_backend": backend}
    result = {"reference": {"dtype": "float32", "quantization": None, "kv_cache_dtype": "auto",
                            "attention_backend": "torch_native"},
              "mode": mode, "dtype": dtype, "quantization": quantization,
              "kv_cache_dtype": kv_cache_dtype, "decode_steps": steps,
              "prompt_tokens": [len(p) for p in prompts], **measure(kv_cache_dtype)}
    if kv_cache_dtype != "auto" and kv_baseline:
        result["kv_auto_baseline"] = measure("auto")["summary"]
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16", help="the mode's dtype (the reference is float32)")
    ap.add_argument("--quantization", default=None, choices=("w8a8_int8",))
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "int8"))
    ap.add_argument("--backend", default="torch_native", help="the mode's attention backend (cpu, torch_native)")
    ap.add_argument("--decode-steps", type=int, default=32, help="greedy tokens decoded after each prompt")
    ap.add_argument("--no-kv-baseline", action="store_true",
                    help="with --kv-cache-dtype int8: skip the same mode with the model-dtype KV cache")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args()
    result = check(args.dtype, args.quantization, args.kv_cache_dtype, args.backend, args.decode_steps,
                   kv_baseline=not args.no_kv_baseline)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
