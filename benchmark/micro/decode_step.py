"""Micro-benchmark of one decode step (model forward + LM head + greedy argmax).

    python benchmark/micro/decode_step.py --batch 32 --ctx 200 [--dtype bfloat16] [--quantization w8a8_int8] [--kv-cache-dtype int8] [--layout interleaved] [--profile | --cprofile]

Builds the model, a KV pool and the attention backend directly (no scheduler), fills
the KV of `batch` requests of length `ctx` with random values, then times decode steps.
This isolates the model/attention cost from scheduling so profiles are readable.
"""
from __future__ import annotations

import argparse
import json
import time

import torch


def build(dtype_name: str, batch: int, ctx: int, shared: int = 0, backend: str = "torch_native",
          quantization: str | None = None, layout: str = "contiguous", kv_cache_dtype: str = "auto"):
    from radixlm.srt.model_runner.attention.base import create_attention_backend
    from radixlm.srt.model_runner.kv_pool import MHATokenToKVPool
    from radixlm.srt.models.registry import build_model
    from radixlm.srt.weights.loader import iter_weights, load_model_config, resolve_dtype, resolve_model_path

    path = resolve_model_path(None)
    cfg = load_model_config(path)
    dtype = resolve_dtype(dtype_name, "cpu")
    model = build_model(cfg, dtype, "cpu")
    model.load_weights(iter_weights(path, cfg))
    model.set_quantization(quantization)
    model.eval()
    total = batch * (ctx + 64) + 1
    pool = MHATokenToKVPool(total, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, dtype,
                            kv_cache_dtype=kv_cache_dtype)
    gen = torch.Generator().manual_seed(0)
    for b in (*pool.k_buffer, *pool.v_buffer):
        if pool.quantized:  # int8 values over the whole range, as quantize_kv writes them
            b[1:] = torch.randint(-127, 128, b[1:].shape, dtype=torch.int8, generator=gen)
        else:
            b[1:].normal_(generator=gen)
    for s in (*pool.k_scale, *pool.v_scale):  # int8 pools only: dequantized values of ~N(0, 1) size
        s[1:] = torch.empty(s[1:].shape).uniform_(0.01, 0.05, generator=gen)
    attn = create_attention_backend(backend, pool, cfg.num_attention_heads,
                                    cfg.num_key_value_heads, cfg.head_dim)
    stride = ctx + 64
    req_to_token = torch.zeros(batch, stride, dtype=torch.int64)
    for i in range(batch):
        if layout == "interleaved":  # token t of request i in slot 1 + t * batch + i, as decode steps allocate
            req_to_token[i] = 1 + torch.arange(stride) * batch + i
        else:
            req_to_token[i] = torch.arange(1 + i * stride, 1 + (i + 1) * stride)
    if layout == "scattered":  # a free list fragmented by many finished requests
        perm = 1 + torch.randperm(total - 1, generator=torch.Generator().manual_seed(0))
        req_to_token = perm[req_to_token - 1]
    if shared:  # every request starts with request 0's first `shared` slots (a radix prefix)
        req_to_token[:, :shared] = req_to_token[0, :shared]
    return model, attn, req_to_token, dtype


def step(model, attn, req_to_token: torch.Tensor, lens: list[int]) -> torch.Tensor:
    from radixlm.srt.model_runner.forward_batch import ForwardBatch, ForwardMode
    b = len(lens)
    loc = torch.tensor([int(req_to_token[i, lens[i]]) for i in range(b)])
    fb = ForwardBatch.build(ForwardMode.DECODE, [100 + i for i in range(b)], loc, list(range(b)),
                            lens, [1] * b, req_to_token)
    attn.init_forward_metadata(fb)
    hidden = model.forward(fb, attn)
    return model.compute_logits(hidden).argmax(-1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=200)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--profile", action="store_true", help="torch.profiler table (torch ops only)")
    ap.add_argument("--cprofile", action="store_true",
                    help="cProfile by Python function: native kernels show up as their ops.py wrappers")
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--shared", type=int, default=0, help="KV slots shared by all requests")
    ap.add_argument("--layout", choices=("contiguous", "interleaved", "scattered"), default="contiguous",
                    help="each request's slots adjacent, interleaved with the others' (the engine's decode "
                         "tokens) or in random order")
    ap.add_argument("--backend", default="cpu", help="attention backend (cpu, torch_native, ...)")
    ap.add_argument("--quantization", default=None, choices=("w8a8_int8",))
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "int8"))
    ap.add_argument("--max-group-keys", type=int, default=None, help="override the backend's cap")
    args = ap.parse_args()
    model, attn, r2t, dtype = build(args.dtype, args.batch, args.ctx, args.shared, args.backend,
                                    args.quantization, args.layout, args.kv_cache_dtype)
    if args.max_group_keys is not None:
        attn.max_group_keys = args.max_group_keys
    lens = [args.ctx - (i % 7) * 3 for i in range(args.batch)]  # slightly ragged, like real batches
    with torch.inference_mode():
        for _ in range(3):
            step(model, attn, r2t, lens)
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            step(model, attn, r2t, lens)
            times.append(time.perf_counter() - t0)
        times.sort()
        res = {"backend": args.backend, "batch": args.batch, "ctx": args.ctx, "shared": args.shared, "layout": args.layout, "dtype": str(dtype).replace("torch.", ""),
               "quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype,
               "threads": torch.get_num_threads(), "median_ms": round(1000 * times[len(times) // 2], 2),
               "min_ms": round(1000 * times[0], 2)}
        print(json.dumps(res))
        if args.cprofile:
            import cProfile
            import pstats
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(10):
                step(model, attn, r2t, lens)
            prof.disable()
            print("cProfile of 10 steps:")
            pstats.Stats(prof).sort_stats("tottime").print_stats(args.rows)
        if args.profile:
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(5):
                    step(model, attn, r2t, lens)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
