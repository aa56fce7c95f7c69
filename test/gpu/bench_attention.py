"""Times decode and extend attention per backend at batch 1/32/128 on one CUDA GPU.

    python -m test.gpu.bench_attention [--dtype bfloat16] [--ctx 1024] [--json out.json]

One attention layer of a Llama-3-8B-like shape (32 query heads, 8 KV heads, head dim
128); each step = init_forward_metadata (once per forward, amortised over layers in a
real model, so reported separately) + forward (KV store + attention). Decode: every
request has `ctx` tokens of KV. Extend: every request adds `ext` new tokens after a
`ctx`-token cached prefix (the radix-hit / chunked-prefill shape); batch 128 extends are
capped to keep the pool within memory. Fits in a few minutes on one GPU.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time

import torch

from radixlm.srt.model_runner.forward_batch import ForwardMode
from test.support.gpu_harness import KVWorld, make_backend

HEADS, KV_HEADS, DIM = 32, 8, 128


def _time(fn, iters: int) -> float:
    """Median milliseconds of fn() over iters runs (CUDA events, after 3 warm-ups)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def bench(backend: str, mode: ForwardMode, batch: int, ctx: int, ext: int, dtype: torch.dtype,
          iters: int) -> dict:
    new = 1 if mode == ForwardMode.DECODE else ext
    world = KVWorld(batch * (ctx + new) + 16, KV_HEADS, DIM, dtype, max_reqs=batch,
                    max_context=ctx + new + 1, poison=False)
    rows = list(range(batch))
    world.fill_prefix(rows, [ctx] * batch, KV_HEADS, DIM)
    attn = make_backend(backend, world, HEADS, KV_HEADS, DIM)
    fb = world.step(mode, rows, [new] * batch)
    t = fb.num_tokens
    q = torch.randn(t, HEADS, DIM, device="cuda").to(dtype)
    k = torch.randn(t, KV_HEADS, DIM, device="cuda").to(dtype)
    v = torch.randn(t, KV_HEADS, DIM, device="cuda").to(dtype)

    def meta() -> None:
        fb.attn_metadata = None
        attn.init_forward_metadata(fb)

    meta()
    attn.forward(q, k, v, 0, fb, DIM ** -0.5)  # compile / plan outside the timing
    meta_ms = _time(meta, max(3, iters // 4))
    meta()
    fwd_ms = _time(lambda: attn.forward(q, k, v, 0, fb, DIM ** -0.5), iters)
    kv_bytes = batch * (ctx + new) * KV_HEADS * DIM * 2 * q.element_size()
    return dict(backend=backend, mode=mode.value, batch=batch, ctx=ctx, new=new, dtype=str(dtype),
                meta_ms=round(meta_ms, 4), forward_ms=round(fwd_ms, 4),
                kv_read_gbps=round(kv_bytes / fwd_ms / 1e6, 1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16", "float32"])
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--ext", type=int, default=256)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--batches", default="1,32,128")
    ap.add_argument("--backends", default="torch_native,triton,flashinfer")
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_attention: no CUDA device, nothing to time")
        return 0
    dtype = getattr(torch, args.dtype)
    backends = []
    for name in args.backends.split(","):
        pkg = {"triton": "triton", "flashinfer": "flashinfer"}.get(name)
        if pkg and importlib.util.find_spec(pkg) is None:
            print(f"skip {name}: {pkg} not installed")
        elif name == "flashinfer" and dtype == torch.float32:
            print("skip flashinfer: no float32 kernels")
        else:
            backends.append(name)
    print(f"{torch.cuda.get_device_name()}  dtype={args.dtype} ctx={args.ctx} ext={args.ext} "
          f"heads={HEADS}/{KV_HEADS} dim={DIM}")
    print(f"{'backend':<13}{'mode':<8}{'batch':>6}{'new':>6}{'meta ms':>10}{'fwd ms':>10}{'KV GB/s':>10}")
    rows = []
    t0 = time.time()
    for mode in (ForwardMode.DECODE, ForwardMode.EXTEND):
        for batch in (int(b) for b in args.batches.split(",")):
            # Extend at batch 128 x 256 new tokens is 32k query tokens: fine, but cap the
            # total so slow backends (torch_native loops per request) stay in budget.
            ext = args.ext if batch * args.ext <= 16384 else max(1, 16384 // batch)
            for name in backends:
                try:
                    r = bench(name, mode, batch, args.ctx, ext, dtype, args.iters)
                except Exception as e:  # keep timing the others; report the failure
                    print(f"{name:<13}{mode.value:<8}{batch:>6}  FAILED: {type(e).__name__}: {e}")
                    rows.append(dict(backend=name, mode=mode.value, batch=batch, error=repr(e)))
                    continue
                rows.append(r)
                print(f"{name:<13}{mode.value:<8}{batch:>6}{r['new']:>6}{r['meta_ms']:>10.3f}"
                      f"{r['forward_ms']:>10.3f}{r['kv_read_gbps']:>10.1f}", flush=True)
                torch.cuda.empty_cache()
    print(f"total {time.time() - t0:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
