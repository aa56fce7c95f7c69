"""bf16 (the CPU default) vs float32 logits of the default model on real prompts.

    python benchmark/micro/logits_check.py

Prefills each prompt in both dtypes through the engine's own model code and reports the
largest logit difference relative to the float32 logit range, and top-1 agreement.
"""
from __future__ import annotations

import json

import torch


def last_logits(dtype_name: str, prompts: list[list[int]]) -> list[torch.Tensor]:
    from radixlm.srt.model_runner.forward_batch import ForwardBatch, ForwardMode
    from decode_step import build  # same directory
    model, attn, _, _ = build(dtype_name, 1, 256)
    out = []
    with torch.inference_mode():
        for ids in prompts:
            table = torch.arange(1, len(ids) + 1, dtype=torch.int64)[None]
            fb = ForwardBatch.build(ForwardMode.EXTEND, ids, table[0], [0], [0], [len(ids)], table)
            attn.init_forward_metadata(fb)
            out.append(model.compute_logits(model.forward(fb, attn)[-1:])[0])
    return out


def main() -> None:
    from radixlm.srt.weights.loader import load_tokenizer, resolve_model_path
    tok = load_tokenizer(resolve_model_path(None))
    texts = ["What is the capital of France?", "Explain photosynthesis to a child.",
             "Write a short essay about the Silk Road.", "List five facts about volcanoes."]
    prompts = []
    for t in texts:
        ids = tok.apply_chat_template([{"role": "user", "content": t}], tokenize=True, add_generation_prompt=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    ref = last_logits("float32", prompts)
    bf = last_logits("bfloat16", prompts)
    rows = []
    for r, b in zip(ref, bf):
        rows.append({"max_abs_diff": round((r - b).abs().max().item(), 4),
                     "rel_to_range": round(((r - b).abs().max() / (r.max() - r.min())).item(), 5),
                     "top1_equal": int(r.argmax()) == int(b.argmax()),
                     "top5_overlap": len(set(r.topk(5).indices.tolist()) & set(b.topk(5).indices.tolist()))})
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
