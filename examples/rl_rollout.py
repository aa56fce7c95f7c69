"""A toy RL rollout/update loop against the radixlm Engine.

    python examples/rl_rollout.py [--model-path DIR_OR_GGUF] [--steps 2]

Each step: generate rollouts with logprobs → "train" (perturb a few weights) → push the
weights with update_weights_from_tensor → generate again; then start a batch of streamed
rollouts, abort it with abort_all once every rollout has produced a token (however slow the
machine, each partial rollout has something in it), and resume every partial rollout from the
cached prefix: its prompt and partial output come back from the prefix cache.
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
        # (ignore_eos: every rollout is still running when the abort comes)
        long_params = {"max_new_tokens": 4 * args.max_new_tokens, "temperature": 0, "ignore_eos": True}
        t0 = time.perf_counter()
        partial = asyncio.run(rollout_then_abort(engine, ids, long_params))
        resumed = engine.generate(
            input_ids=[i + out_ids for i, (out_ids, _) in zip(ids, partial)],
            sampling_params=[{**long_params, "max_new_tokens": long_params["max_new_tokens"] - len(out_ids)}
                             for out_ids, _ in partial])
        for prompt, (out_ids, reason), r in zip(ids, partial, resumed):
            print(f"  partial {len(out_ids)} tokens ({reason}), resumed +{len(r['output_ids'])} with "
                  f"{r['meta_info']['cached_tokens']} of {len(prompt) + len(out_ids)} prompt tokens cached")
        print(f"abort + resume took {time.perf_counter() - t0:.2f} s")


async def rollout_then_abort(engine: Engine, ids: list[list[int]], params: dict) -> list[tuple[list[int], str]]:
    """Stream one rollout per prompt; abort them all once each has produced a token. Returns
    each rollout's output ids and finish reason."""
    first_token = [asyncio.Event() for _ in ids]

    async def one(k: int, prompt: list[int]) -> tuple[list[int], str]:
        out_ids: list[int] = []
        reason = "none"
        try:
            async for chunk in await engine.async_generate(input_ids=prompt, sampling_params=params, stream=True):
                out_ids += chunk["output_ids"]
                if out_ids:
                    first_token[k].set()
                if chunk["meta_info"].get("finish_reason"):
                    reason = chunk["meta_info"]["finish_reason"]["type"]
        finally:
            first_token[k].set()  # ended without a token: nothing to wait for
        return out_ids, reason

    tasks = [asyncio.ensure_future(one(k, prompt)) for k, prompt in enumerate(ids)]
    await asyncio.gather(*(e.wait() for e in first_token))
    engine.abort_request(abort_all=True)
    return list(await asyncio.gather(*tasks))


if __name__ == "__main__":
    main()
