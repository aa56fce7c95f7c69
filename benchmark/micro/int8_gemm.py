"""The w8a8 int8 GEMMs of one decode step, alone: every linear of a Llama-shaped model (default
SmolLM2-135M's shapes, random weights) at batch M, with each layer's own weights (streamed
from DRAM, as in a real step: "cold") and with one layer's weights reused (cache-resident:
"warm"). The gap is the weight streaming the kernel fails to hide. Prints JSON.

    python benchmark/micro/int8_gemm.py [--batch 32] [--repeats 15]
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from radixlm.srt.layers.int8_linear import int8_linear, native_available, quantize_weight


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--kv-dim", type=int, default=192, help="num_key_value_heads * head_dim")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    torch.manual_seed(0)
    h, i = args.hidden, args.intermediate
    shapes = [(h + 2 * args.kv_dim, h), (h, h), (2 * i, h), (h, i)]  # qkv, o, gate_up, down
    layers = [[quantize_weight(torch.randn(n, k, dtype=torch.bfloat16)) for n, k in shapes]
              for _ in range(args.layers)]
    head = quantize_weight(torch.randn(args.vocab, h, dtype=torch.bfloat16))
    xs = {k: torch.randn(args.batch, k, dtype=torch.bfloat16) for _, k in shapes}
    macs = args.batch * (sum(n * k for n, k in shapes) * args.layers + args.vocab * h)

    def run(per_layer: list[list]) -> None:
        for weights in per_layer:
            for w, (_, k) in zip(weights, shapes):
                int8_linear(xs[k], w, None)
        int8_linear(xs[h], head, None, torch.float32)

    res: dict = {"batch": args.batch, "layers": args.layers, "native": native_available(),
                 "threads": torch.get_num_threads(), "gmac_per_pass": round(macs / 1e9, 3)}
    for name, per_layer in (("cold", layers), ("warm", [layers[0]] * args.layers)):
        run(per_layer)
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            run(per_layer)
            times.append(time.perf_counter() - t0)
        med = sorted(times)[len(times) // 2]
        res[name] = {"median_ms": round(med * 1e3, 2), "gmac_per_s": round(macs / med / 1e9, 1)}
    print(json.dumps(res))


if __name__ == "__main__":
    main()
