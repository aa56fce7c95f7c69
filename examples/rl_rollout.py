"""A toy RL rollout/update loop against the radixlm Engine.

    python examples/rl_rollout.py [--model-path DIR_OR_GGUF] [--steps 2]

Each step: generate rollouts with logprobs → "train" (perturb a few weights) → push the
weights with update_weights_from_tensor → generate again; then start a batch, abort it
mid-flight with abort_all, and resume every partial rollout from the cached prefix.
"""
from __future__ import annotations

import argparse
import asyncio
import time

import torch

from radixlm import Engine

PROMPTS = ["Write a short poem about the sea.", "What is 17 times 23?", "Name three prime numbers.",
           "Describe a cat in one sentence."]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    args = ap.parse_args()

    with Engine(model_path=args.model_path) as engine:
        tok = engine.tokenizer
        prompts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                           add_generation_prompt=True) for p in PROMPTS]
        ids = [tok.encode(p, add_special_tokens=False) for p in prompts]
        params = {"max_new_tokens": args.max_new_tokens, "temperature": 0.8, "seed": 0}
        name = "model.layers.0.mlp.down_proj.weight"
        for step in range(args.steps):
            outs = engine.generate(input_ids=ids, sampling_params=params, return_logprob=True)
            mean_lp = sum(lp for o in outs for lp, _, _ in o["meta_info"]["output_token_logprobs"]) / \
                max(1, sum(len(o["output_ids"]) for o in outs))
            print(f"step {step}: weight_version={outs[0]['meta_info']['weight_version']} "
                  f"mean logprob {mean_lp:.3f}; sample: {outs[0]['text'][:60]!r}")
            # "training": nudge one matrix and push it
            w = torch.tensor(engine.get_weights_by_name(name, truncate_size=10**9))
            w += 0.01 * torch.randn_like(w)
            res = engine.update_weights_from_tensor([(name, w)], weight_version=f"step-{step + 1}")
            print(f"  pushed {res['num_tensors']} tensor(s) -> version {res['weight_version']}")

        # partial rollouts: abort mid-batch, then continue each from where it stopped
        long_params = {"max_new_tokens": 4 * args.max_new_tokens, "temperature": 0}

        async def rollout():
            tasks = [asyncio.ensure_future(engine.async_generate(input_ids=i, sampling_params=long_params))
                     for i in ids]
            await asyncio.sleep(0.5)
            engine.abort_request(abort_all=True)
            return await asyncio.gather(*tasks)

        t0 = time.perf_counter()
        partial = asyncio.run(rollout())
        resumed = engine.generate(
            input_ids=[i + o["output_ids"] for i, o in zip(ids, partial)],
            sampling_params=[{**long_params, "max_new_tokens": long_params["max_new_tokens"] - len(o["output_ids"])}
                             for o in partial])
        for o, r in zip(partial, resumed):
            print(f"  partial {len(o['output_ids'])} tokens ({o['meta_info']['finish_reason']['type']}), "
                  f"resumed +{len(r['output_ids'])} with {r['meta_info']['cached_tokens']} cached tokens")
        print(f"abort + resume took {time.perf_counter() - t0:.2f} s")


if __name__ == "__main__":
    main()
