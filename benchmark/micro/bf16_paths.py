"""The two bf16 kernel paths of an AMX CPU side by side in one process: radixlm's bf16 GEMM
(the default model's linears) and its prefill attention on AMX tiles (the native build) and on
AVX512-BF16 (the `avx512` build, which has no tiles), and oneDNN's prepacked bf16 linear for
the GEMMs. Prints JSON: microseconds (best of --repeats timed batches) and TFLOP/s.

    python benchmark/micro/bf16_paths.py [--rows 1,4,32,256,1024] [--repeats 5] [--out F.json]

On a CPU without AMX both builds take AVX512-BF16, and the script says so.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import emit  # noqa: E402

# (name, out_features, in_features) of one decoder layer of SmolLM2-135M, and its LM head.
LINEARS = [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536),
           ("lm_head", 49152, 576)]
# (cached prefix, new tokens) per request of a prefill chunk: 9 query heads, 3 KV heads, D 64.
ATTENTION = [([0], [1024]), ([1024], [1024]), ([0] * 8, [256] * 8)]


def attention_batch(prefixes: list[int], exts: list[int], hq: int = 9, hkv: int = 3, d: int = 64,
                    slots: int = 4096) -> tuple:
    """q [tokens, hq, d] and a bf16 pool with the requests' keys at scattered slots, as
    ops.extend_attention takes them."""
    g = torch.Generator().manual_seed(0)
    lens = [p + e for p, e in zip(prefixes, exts)]
    k_buf = torch.zeros(slots, hkv, d, dtype=torch.bfloat16)
    v_buf = torch.zeros_like(k_buf)
    kv_indices = torch.randperm(slots, generator=g)[:sum(lens)]
    k_buf[kv_indices] = torch.randn(sum(lens), hkv, d, generator=g).bfloat16()
    v_buf[kv_indices] = torch.randn(sum(lens), hkv, d, generator=g).bfloat16()
    q = torch.randn(sum(exts), hq, d, generator=g).bfloat16()
    return (q, k_buf, v_buf, torch.tensor([0, *exts]).cumsum(0), torch.tensor([0, *lens]).cumsum(0), kv_indices)


def best_us(fn, repeats: int, budget_s: float = 0.05) -> float:
    fn()
    t0 = time.perf_counter()
    fn()
    n = max(1, int(budget_s / max(time.perf_counter() - t0, 1e-6)))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
    return best * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,4,32,256,1024")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out")
    args = ap.parse_args()
    from radixlm.kernels.cpu import build, ops
    from radixlm.srt.layers import bf16_gemm

    libs = {"native": build.load(), "avx512": build.load_variant("avx512")}
    build._lib = libs["native"]
    out: dict = {"amx": ops.bf16_gemm_amx(), "threads": torch.get_num_threads(), "gemm": [], "attention": []}

    def on(lib, fn):
        build._lib = lib
        try:
            return fn()
        finally:
            build._lib = libs["native"]

    g = torch.Generator().manual_seed(0)
    for name, n, k in LINEARS:
        w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
        packed = bf16_gemm.pack_weight(w)
        onednn = torch.ops.mkldnn._reorder_linear_weight(w.clone(), 32)
        for m in (int(r) for r in args.rows.split(",")):
            if name == "lm_head" and m > 32:
                continue  # only the rows that become logits reach the LM head
            x = torch.randn(m, k, generator=g).bfloat16()
            row = {"linear": name, "rows": m, "n": n, "k": k}
            for path, lib in libs.items():
                row[f"{path}_us"] = round(on(lib, lambda: best_us(lambda: bf16_gemm.linear(x, packed, None),
                                                                  args.repeats)), 1)
            row["onednn_us"] = round(best_us(lambda: torch.ops.mkldnn._linear_pointwise(x, onednn, None, "none",
                                                                                       [], ""), args.repeats), 1)
            for key in ("native", "avx512", "onednn"):
                row[f"{key}_tflops"] = round(2 * m * n * k / row[f"{key}_us"] / 1e6, 2)
            out["gemm"].append(row)
    for prefixes, exts in ATTENTION:
        batch = attention_batch(prefixes, exts)
        flops = sum(4 * e * (p + (e + 1) / 2) * 64 * 9 for p, e in zip(prefixes, exts))
        row = {"requests": len(exts), "prefix": prefixes[0], "new_tokens": exts[0]}
        for path, lib in libs.items():
            us = on(lib, lambda: best_us(lambda: ops.extend_attention(*batch, 0.125), args.repeats))
            row[f"{path}_us"], row[f"{path}_tflops"] = round(us, 1), round(flops / us / 1e6, 2)
        out["attention"].append(row)
    emit(out, args.out)


if __name__ == "__main__":
    main()
