"""Do the packed weights' pages matter? A decode step streams every layer's packed int8 weight
from DRAM; each is 0.3-3.5 MiB, below the size at which a buffer gets a huge-page mapping of its
own (radixlm/kernels/cpu/hugepages.py).

    python benchmark/micro/weight_pages.py [--batch 32] [--rounds 40]

Packs two copies of 30 layers of the default model's int8 weights (random values, its shapes:
qkv, o, gate_up silu-gated, down): one in plain torch.empty buffers (small pages), one through
empty_hugepage (the shared huge-page mappings). Then runs the step's GEMMs over each copy in
turn, alternated pass by pass so the host's drift falls on both, and prints JSON: median and
p10 ms per pass of the 120 GEMMs. The two copies together (~240 MB) do not fit any cache, so
each pass reads its weights from DRAM as a decode step does.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from radixlm.kernels.cpu import ops
from radixlm.kernels.cpu.hugepages import hugepages_enabled

LAYERS, H, I, NQKV = 30, 576, 1536, 960  # SmolLM2-135M: hidden, MLP width, q + k + v


def pack_layers(huge: bool) -> list[ops.Int8Gemm]:
    from radixlm.srt.layers.int8_linear import quantize_weight

    os.environ["RADIXLM_HUGEPAGES"] = "1" if huge else "0"  # read at each allocation
    try:
        gemms = []
        for _ in range(LAYERS):
            for (n, k), gated in (((NQKV, H), False), ((H, H), False), ((2 * I, H), True), ((H, I), False)):
                w = quantize_weight(torch.randn(n, k) * 0.05, pack=True, silu_gated=gated)
                gemms.append(w.gemm)
        return gemms
    finally:
        os.environ.pop("RADIXLM_HUGEPAGES", None)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=40)
    args = ap.parse_args()
    if not ops.available():
        raise SystemExit("the native CPU kernels are not available")
    if not hugepages_enabled():
        raise SystemExit("huge pages are off here (RADIXLM_HUGEPAGES=0 or not Linux)")
    copies = {"small_pages": pack_layers(False), "huge_pages": pack_layers(True)}
    xs = {k: torch.randn(args.batch, k, dtype=torch.bfloat16) for k in (H, I)}
    times: dict[str, list[float]] = {name: [] for name in copies}
    for r in range(args.rounds + 2):
        for name, gemms in copies.items():
            t0 = time.perf_counter()
            for g in gemms:
                g(xs[g.k], None, torch.bfloat16)
            if r >= 2:
                times[name].append(time.perf_counter() - t0)
    res = {"batch": args.batch, "rounds": args.rounds, "gemms_per_pass": len(copies["huge_pages"]),
           "threads": torch.get_num_threads()}
    for name, ts in times.items():
        ts.sort()
        res[name] = {"median_ms": round(statistics.median(ts) * 1e3, 3), "p10_ms": round(ts[len(ts) // 10] * 1e3, 3)}
    res["speedup_median"] = round(res["small_pages"]["median_ms"] / res["huge_pages"]["median_ms"], 3)
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
