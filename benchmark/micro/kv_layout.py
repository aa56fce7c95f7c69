"""Decode attention over the int8 KV cache: does the order of a request's slots matter?

    python benchmark/micro/kv_layout.py [--batch 32] [--ctx 200] [--rounds 15]

Continuous batching hands a running batch's decode slots out one request after another, so
past its prompt a request's keys sit `batch` slots apart (interleaved), where a paged or
per-request allocator would keep them together (contiguous). This times the native int8 decode
kernel over 30 layers of the default model's shape with both orders of the same slots,
alternated, and prints JSON: median ms per step and the KV bytes read per second.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from radixlm.kernels.cpu import ops

LAYERS, HQ, HKV, D = 30, 9, 3, 64  # SmolLM2-135M


def slot_orders(batch: int, ctx: int, prompt: int) -> dict[str, torch.Tensor]:
    contiguous = torch.cat([1 + r * ctx + torch.arange(ctx) for r in range(batch)])
    interleaved = torch.cat([torch.cat([1 + r * prompt + torch.arange(prompt),
                                        1 + batch * prompt + torch.arange(ctx - prompt) * batch + r])
                             for r in range(batch)])
    return {"contiguous": contiguous, "interleaved": interleaved}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=200)
    ap.add_argument("--prompt", type=int, default=40, help="leading slots of each request kept together")
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    if not ops.available():
        raise SystemExit("the native CPU kernels are not available")
    torch.manual_seed(0)
    slots = args.batch * args.ctx + 1
    pools = [(torch.randint(-127, 127, (slots, HKV, D), dtype=torch.int8),
              torch.randint(-127, 127, (slots, HKV, D), dtype=torch.int8),
              torch.rand(slots, HKV) * 0.01, torch.rand(slots, HKV) * 0.01) for _ in range(LAYERS)]
    q = torch.randn(args.batch, HQ, D, dtype=torch.bfloat16)
    indptr = torch.arange(args.batch + 1, dtype=torch.int64) * args.ctx
    orders = slot_orders(args.batch, args.ctx, args.prompt)

    def step(indices: torch.Tensor) -> float:
        t0 = time.perf_counter()
        for k, v, ks, vs in pools:
            ops.decode_attention_int8(q, k, v, ks, vs, indptr, indices, D ** -0.5)
        return time.perf_counter() - t0

    times: dict[str, list[float]] = {name: [] for name in orders}
    for _ in range(args.rounds):
        for name, indices in orders.items():
            times[name].append(step(indices))
    kv_bytes = args.batch * args.ctx * LAYERS * HKV * (2 * D + 8)
    med = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
    print(json.dumps({"batch": args.batch, "ctx": args.ctx, "layers": LAYERS, "kv_bytes_per_step": kv_bytes,
                      "ms_per_step": {n: round(s * 1e3, 3) for n, s in med.items()},
                      "GB_per_s": {n: round(kv_bytes / s / 1e9, 1) for n, s in med.items()},
                      "contiguous_speedup": round(med["interleaved"] / med["contiguous"], 3)}, indent=1))


if __name__ == "__main__":
    main()
