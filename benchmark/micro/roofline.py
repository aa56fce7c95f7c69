"""This machine's limits, for docs/performance.md: the core clock, per-core and all-core peak
multiply-accumulates per second in each instruction form radixlm's kernels use (fp32 FMA on
256/512-bit vectors, int8 dots as the AVX2 sign trick or AVX512-VNNI, AVX512-BF16 dots, AMX
bf16 tile products) and in the shape of the bf16 and w8a8 GEMMs' micro-kernels (their loads,
broadcasts and per-group fold from L1, against the bare instruction's peak), and
DRAM read bandwidth with 1 and all threads (streaming, and in the scattered rows a decode batch's
KV pool is read in); then what the GEMMs of a decode step reach
against them (torch fp32/bf16, radixlm's int8 and float kernels) at batch 1 and 32, and the
KV cache's bytes per token of the default model in each KV dtype. Prints JSON.

    python benchmark/micro/roofline.py [--seconds 0.3] [--repeats 5] [--out F.json]

Each peak is the best of --repeats timed runs (other processes only ever make a run slower).
The all-core figures run one copy per core at once. Peaks come from roofline_kernels.cpp,
compiled here with the system compiler (-O3 -march=native).
"""
from __future__ import annotations

import argparse
import ctypes
import hashlib
import os
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from common import emit  # noqa: E402

SRC = os.path.join(HERE, "roofline_kernels.cpp")
KERNELS = os.path.join(os.path.dirname(os.path.dirname(HERE)), "radixlm", "kernels", "cpu")  # amx.h
PEAKS = {  # name -> (what it measures, MACs per instruction)
    "fma256": "fp32 FMA, 256-bit (8 MACs per vfmadd231ps)",
    "fma512": "fp32 FMA, 512-bit (16 MACs per vfmadd231ps)",
    "int8_avx2": "int8 dot, AVX2 sign trick (vpsignb + vpmaddubsw + vpmaddwd + vpaddd = 32 MACs)",
    "vnni512": "int8 dot, AVX512-VNNI (64 MACs per vpdpbusd)",
    "bf16dp512": "bf16 dot, AVX512-BF16 (32 MACs per vdpbf16ps)",
    "bf16dp512_tile": "bf16 GEMM micro-kernel from L1: per k pair 4 weight loads, 6 vpbroadcastd, 24 vdpbf16ps",
    "vnni512_group": "w8a8 GEMM micro-kernel, one group of 32 k from L1: 96 vpdpbusd, then 12 vcvtdq2ps + vfmadd231ps",
    "amx_bf16": "bf16 tile product, AMX (8,192 MACs per tdpbf16ps)",
}


def build() -> ctypes.CDLL:
    h = hashlib.sha256()
    for path in (SRC, os.path.join(KERNELS, "amx.h")):
        with open(path, "rb") as f:
            h.update(f.read())
    out = os.path.join(tempfile.gettempdir(), f"radixlm_roofline_{h.hexdigest()[:12]}_{os.getuid()}.so")
    if not os.path.exists(out):
        tmp = out + f".{os.getpid()}"
        subprocess.run(["g++", "-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", f"-I{KERNELS}", SRC, "-o", tmp],
                       check=True)
        os.replace(tmp, out)
    lib = ctypes.CDLL(out)
    lib.rl_clock.argtypes = [ctypes.c_int64]
    lib.rl_clock.restype = ctypes.c_int64
    lib.rl_read.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    lib.rl_read.restype = ctypes.c_int64
    lib.rl_read_rows.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                 ctypes.c_int]
    lib.rl_read_rows.restype = ctypes.c_int64
    return lib


def best_rate(fn, work_per_call: float, seconds: float, repeats: int, copies: int = 1) -> float:
    """Best work/second over `repeats` runs of ~`seconds`; `copies` threads at once (ctypes
    drops the GIL), the rate summed over them."""
    best = 0.0
    for _ in range(repeats):
        elapsed = [0.0] * copies

        def one(i: int) -> None:
            t0 = time.perf_counter()
            fn()
            elapsed[i] = time.perf_counter() - t0

        threads = [threading.Thread(target=one, args=(i,)) for i in range(copies)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        best = max(best, sum(work_per_call / e for e in elapsed))
    return best


def calibrate(call, seconds: float) -> int:
    """Iterations of call(iters) that take about `seconds`."""
    iters = 1 << 16
    while True:
        t0 = time.perf_counter()
        call(iters)
        dt = time.perf_counter() - t0
        if dt > seconds / 4:
            return max(1, int(iters * seconds / dt))
        iters *= 4


def peaks(lib: ctypes.CDLL, seconds: float, repeats: int, cores: int) -> dict:
    out: dict = {}
    clock_iters = calibrate(lib.rl_clock, seconds)
    cycles = clock_iters * lib.rl_clock_cycles_per_iter()
    out["clock_ghz"] = round(best_rate(lambda: lib.rl_clock(clock_iters), cycles, seconds, repeats) / 1e9, 2)
    for name, what in PEAKS.items():
        fn = getattr(lib, f"rl_{name}", None)
        if fn is None:
            out[name] = {"what": what, "available": False}
            continue
        fn.argtypes = [ctypes.c_int64]
        fn.restype = ctypes.c_double
        per_iter = getattr(lib, f"rl_{name}_macs_per_iter")()
        iters = calibrate(fn, seconds)
        one = best_rate(lambda: fn(iters), iters * per_iter, seconds, repeats)
        allc = best_rate(lambda: fn(iters), iters * per_iter, seconds, repeats, copies=cores)
        out[name] = {"what": what, "gmac_per_s_1core": round(one / 1e9, 1),
                     "macs_per_cycle_1core": round(one / (out["clock_ghz"] * 1e9), 1),
                     f"gmac_per_s_{cores}cores": round(allc / 1e9, 1)}
    return out


def dram(lib: ctypes.CDLL, repeats: int, cores: int, mib: int) -> dict:
    import torch
    # Random contents, so that no host that merges identical pages can back the buffer by fewer.
    buf = torch.randint(0, 1 << 62, (mib << 17,), dtype=torch.int64)  # mib MiB
    out = {"buffer_mib": mib}
    for th in sorted({1, cores}):
        lib.rl_read(buf.data_ptr(), buf.numel(), th)
        rate = best_rate(lambda: lib.rl_read(buf.data_ptr(), buf.numel(), th), buf.numel() * 8, 0, repeats)
        out[f"read_gb_per_s_{th}threads"] = round(rate / 1e9, 1)
    # Decode attention reads each request's K/V rows where decode steps put them: one slot per
    # request per step, so a batch of 32 leaves a request's rows 32 slots apart. 192 B is one
    # int8 K (or V) row of the default model (3 KV heads x 64), 384 B a bf16 one.
    reqs = 32
    rows = {}
    for row_bytes in (192, 384):
        per_req = buf.numel() * 8 // (row_bytes * reqs)
        for run in (1, 16, per_req):
            name = f"{row_bytes}B_rows_{'contiguous' if run == per_req else f'runs_of_{run}'}"
            rows_read = per_req // run * run
            args = (buf.data_ptr(), row_bytes, rows_read, reqs, run, cores)
            lib.rl_read_rows(*args)
            rate = best_rate(lambda a=args: lib.rl_read_rows(*a), reqs * rows_read * row_bytes, 0, repeats)
            rows[name] = round(rate / 1e9, 1)
    out[f"decode_rows_read_gb_per_s_{cores}threads"] = {"requests": reqs, **rows}
    return out


def gemm_rates(repeats: int) -> dict:
    """Achieved GMAC/s of one decode-step-shaped GEMM (K 576 -> N 3072, SmolLM2's gate_up) at
    batch 1 and 32, warm caches, every implementation available here."""
    import torch
    import torch.nn.functional as F

    from radixlm.srt.layers.int8_linear import int8_linear, native_available, quantize_weight
    torch.manual_seed(0)
    k, n = 576, 3072
    out: dict = {"shape": [k, n], "threads": torch.get_num_threads()}
    w32 = torch.randn(n, k)
    impls = {"torch_fp32": (lambda x: F.linear(x, w32), torch.float32),
             "torch_bf16": (lambda x, w=w32.bfloat16(): F.linear(x, w), torch.bfloat16)}
    if native_available():
        q = quantize_weight(w32)
        impls["radixlm_int8"] = (lambda x: int8_linear(x, q, None), torch.bfloat16)
    try:
        from radixlm.srt.layers import float_gemm
        if float_gemm.available():
            for dt in (torch.float32, torch.bfloat16):
                pw = float_gemm.pack_weight(w32.to(dt))
                impls[f"radixlm_{str(dt).split('.')[-1]}"] = (lambda x, pw=pw: float_gemm.linear(x, pw, None), dt)
        from radixlm.srt.layers import bf16_gemm
        from radixlm.srt.layers.linear import mkldnn_pack_supported, pack_weight, packed_linear
        if bf16_gemm.available():  # AVX512-BF16: what a bf16 Linear multiplies through
            pb = bf16_gemm.pack_weight(w32.bfloat16())
            impls["radixlm_bf16_dp"] = (lambda x, pb=pb: bf16_gemm.linear(x, pb, None), torch.bfloat16)
        if mkldnn_pack_supported(torch.bfloat16, "cpu"):  # the oneDNN-prepacked matmul it replaced
            pm = pack_weight(w32.bfloat16())
            impls["onednn_bf16_prepacked"] = (lambda x, pm=pm: packed_linear(x, pm, None), torch.bfloat16)
    except ImportError:
        pass
    for m in (1, 32):
        row = {}
        for name, (fn, dt) in impls.items():
            x = torch.randn(m, k).to(dt)
            reps = max(1, int(2e8 / (m * k * n)))
            for _ in range(3):
                fn(x)
            best = 0.0
            for _ in range(repeats):
                t0 = time.perf_counter()
                for _ in range(reps):
                    fn(x)
                best = max(best, reps * m * k * n / (time.perf_counter() - t0))
            row[name] = round(best / 1e9, 1)
        out[f"batch{m}_gmac_per_s"] = row
    return out


def kv_bytes_per_token() -> dict:
    """KV cache bytes per token of the default model (all layers, K and V) in each KV dtype."""
    import torch

    from radixlm.srt.model_runner.kv_pool import MHATokenToKVPool
    from radixlm.srt.weights.loader import load_model_config, resolve_model_path
    cfg = load_model_config(resolve_model_path(None))
    dims = (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim)
    return {"model": f"{cfg.num_hidden_layers} layers x {cfg.num_key_value_heads} KV heads x {cfg.head_dim}",
            "float32": MHATokenToKVPool.bytes_per_token(*dims, torch.float32),
            "bfloat16": MHATokenToKVPool.bytes_per_token(*dims, torch.bfloat16),
            "int8": MHATokenToKVPool.bytes_per_token(*dims, torch.bfloat16, "int8")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=0.3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dram-mib", type=int, default=1024)
    ap.add_argument("--out")
    args = ap.parse_args()
    cores = os.cpu_count() or 1
    lib = build()
    res = {"benchmark": "roofline", "cores": cores, "peaks": peaks(lib, args.seconds, args.repeats, cores),
           "dram": dram(lib, args.repeats, cores, args.dram_mib), "gemm": gemm_rates(args.repeats),
           "kv_bytes_per_token": kv_bytes_per_token()}
    emit(res, args.out)


if __name__ == "__main__":
    main()
