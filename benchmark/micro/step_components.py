"""Each component of one decode step, timed alone at the default model's shapes, against this
machine's limits (roofline.py): the linears (and LM head) in GMAC/s against the MAC peak of
their instruction form and in GB/s of weights streamed against DRAM, decode attention in GB/s
of KV read, the elementwise ops in microseconds. Prints JSON.

    python benchmark/micro/step_components.py [--batch 32] [--ctx 200] [--dtype bfloat16] [--quantization w8a8_int8] [--kv-cache-dtype int8] [--repeats 20]

Each figure is the best of --repeats timed calls (other processes only slow a call down), so
the sum is what a quiet machine's step would spend in these kernels; the weights of 30 layers
are distinct tensors, so they stream from DRAM as in a real step, and the KV rows of the batch
interleave in the pool as concurrent decodes leave them.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import emit  # noqa: E402


def best(fn, repeats: int) -> float:
    fn()
    t = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        t = min(t, time.perf_counter() - t0)
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=200)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default=None, choices=("w8a8_int8",))
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "int8"))
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out")
    args = ap.parse_args()
    from radixlm.kernels.cpu import ops
    from radixlm.srt.layers.linear import Linear
    from radixlm.srt.model_runner.kv_pool import quantize_kv
    from radixlm.srt.weights.loader import load_model_config, resolve_dtype, resolve_model_path
    cfg = load_model_config(resolve_model_path(None))
    dtype = resolve_dtype(args.dtype, "cpu")
    torch.manual_seed(0)
    b, h, i, L = args.batch, cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    shapes = {"qkv": (h, (hq + 2 * hkv) * d), "o": (hq * d, h), "gate_up": (h, 2 * i), "down": (i, h)}
    res: dict = {"batch": b, "ctx": args.ctx, "dtype": str(dtype).replace("torch.", ""), "quantization": args.quantization,
                 "kv_cache_dtype": args.kv_cache_dtype, "threads": torch.get_num_threads(), "components_ms": {}}
    comp = res["components_ms"]
    detail: dict = {}

    def linears(k: int, n: int, layers: int):
        mods = []
        for _ in range(layers):
            m = Linear(k, n, dtype=dtype)
            m.weight.data.normal_(std=k ** -0.5)
            m.quantization = args.quantization
            mods.append(m)
        return mods

    with torch.inference_mode():
        for name, (k, n) in shapes.items():
            mods = linears(k, n, L)
            x = torch.randn(b, k).to(dtype)
            t = best(lambda: [m(x) for m in mods], args.repeats)
            wbytes = L * k * n * (1 if args.quantization else dtype.itemsize)
            comp[f"linear_{name}_x{L}"] = round(t * 1e3, 3)
            detail[name] = {"gmac_per_s": round(L * b * k * n / t / 1e9, 1), "weight_gb_per_s": round(wbytes / t / 1e9, 1)}
        head = linears(h, cfg.vocab_size, 1)[0]
        x = torch.randn(b, h).to(dtype)
        t = best(lambda: head(x), args.repeats)
        comp["lm_head"] = round(t * 1e3, 3)
        detail["lm_head"] = {"gmac_per_s": round(b * h * cfg.vocab_size / t / 1e9, 1)}
        # decode attention, keys of the batch interleaved in the pool
        slots = b * args.ctx + 1
        indptr = torch.arange(0, b * args.ctx + 1, args.ctx, dtype=torch.int64)
        indices = (torch.arange(args.ctx)[None, :] * b + torch.arange(b)[:, None]).reshape(-1) + 1
        q = torch.randn(b, hq, d).to(dtype)
        pools = []
        for _ in range(L):
            kf, vf = torch.randn(slots, hkv, d), torch.randn(slots, hkv, d)
            if args.kv_cache_dtype == "int8":
                pools.append((*quantize_kv(kf), *quantize_kv(vf)))
            else:
                pools.append((kf.to(dtype), vf.to(dtype)))
        if args.kv_cache_dtype == "int8":
            def attn():
                for kq, ks, vq, vs in pools:
                    ops.decode_attention_int8(q, kq, vq, ks, vs, indptr, indices, d ** -0.5)
            kv_bytes = L * b * args.ctx * hkv * 2 * (d + 4)
        else:
            def attn():
                for kb, vb in pools:
                    ops.decode_attention(q, kb, vb, indptr, indices, d ** -0.5)
            kv_bytes = L * b * args.ctx * hkv * 2 * d * dtype.itemsize
        t = best(attn, max(3, args.repeats // 4))
        comp[f"decode_attention_x{L}"] = round(t * 1e3, 3)
        detail["decode_attention"] = {"kv_gb_per_s": round(kv_bytes / t / 1e9, 1),
                                      "gmac_per_s": round(L * 2 * b * args.ctx * hq * d / t / 1e9, 1)}
        xs = torch.randn(b, h).to(dtype)
        w = torch.ones(h, dtype=dtype)
        gu = torch.randn(b, 2 * i).to(dtype)
        qk = torch.randn(b, hq + hkv, d).to(dtype)
        pos = torch.full((b,), args.ctx, dtype=torch.int64)
        cos, sin = torch.randn(args.ctx + 1, d // 2), torch.randn(args.ctx + 1, d // 2)
        comp[f"add_rmsnorm_x{2 * L + 1}"] = round(best(lambda: [ops.add_rmsnorm(xs, xs.clone(), w, 1e-5)
                                                               for _ in range(2 * L + 1)], args.repeats) * 1e3, 3)
        comp[f"silu_mul_x{L}"] = round(best(lambda: [ops.silu_mul(gu) for _ in range(L)], args.repeats) * 1e3, 3)
        comp[f"rope_x{L}"] = round(best(lambda: [ops.rope_inplace(qk, pos, cos, sin) for _ in range(L)],
                                        args.repeats) * 1e3, 3)
        logits = torch.randn(b, cfg.vocab_size)
        comp["argmax"] = round(best(lambda: ops.argmax_rows(logits), args.repeats) * 1e3, 3)
    res["sum_ms"] = round(sum(comp.values()), 2)
    res["detail"] = detail
    emit(res, args.out)


if __name__ == "__main__":
    main()
