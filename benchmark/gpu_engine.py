"""The Engine on a CUDA GPU: every attention backend x overlap on/off, greedy agreement and
throughput at several batch sizes; prints one JSON object.

    python benchmark/gpu_engine.py [--model-path P] [--dtypes float32,bfloat16]
        [--backends torch_native,triton,flashinfer] [--batches 1,32,256] [--output-len 128] [--out F.json]

Per dtype, each backend (those not installed are listed under `skipped`) runs twice, with
--disable-overlap-schedule and with --enable-overlap-schedule, each in an Engine of its own:
  check       16 chat prompts x 32 greedy tokens; `agreement` compares every run's outputs
              with torch_native's overlap-off run of the same dtype (float32 must be identical:
              the backends compute the same sums in other orders, so bf16 may drift)
  batches     B chat prompts x --output-len tokens, EOS ignored, cold cache: output tok/s
  forward_idle_fraction   the GPU's idle share between forwards over the whole run (the
              scheduler cost that overlap did not hide)
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import emit  # noqa: E402
from offline_throughput import make_prompts  # noqa: E402

CHECK_PROMPTS, CHECK_TOKENS = 16, 32
NEEDS = {"triton": "triton", "flashinfer": "flashinfer"}  # backend -> module it imports


def run_config(model_path: str | None, device: str, dtype: str, backend: str, overlap: bool,
               prompts: dict[int, list], output_len: int) -> dict:
    from radixlm import Engine

    row: dict = {"dtype": dtype, "backend": backend, "overlap": overlap}
    t0 = time.perf_counter()
    try:
        engine = Engine(model_path=model_path, device=device, dtype=dtype, attention_backend=backend,
                        enable_overlap_schedule=overlap, disable_overlap_schedule=not overlap,
                        max_running_requests=max(prompts))
    except Exception as e:  # one broken configuration must not hide the others' results
        row["error"] = f"start: {type(e).__name__}: {str(e)[-2000:]}"
        return row
    row["load_s"] = round(time.perf_counter() - t0, 2)
    try:
        check = prompts[CHECK_PROMPTS][:CHECK_PROMPTS]
        outs = engine.generate(input_ids=check, sampling_params={"max_new_tokens": CHECK_TOKENS, "temperature": 0.0})
        row["check_outputs"] = [o["output_ids"] for o in outs]
        params = {"max_new_tokens": output_len, "temperature": 0.0, "ignore_eos": True}
        row["batches"] = {}
        for b, batch in sorted(prompts.items()):
            engine.flush_cache()
            t0 = time.perf_counter()
            outs = engine.generate(input_ids=batch, sampling_params=params)
            wall = time.perf_counter() - t0
            n = sum(len(o["output_ids"]) for o in outs)
            row["batches"][str(b)] = {"output_tok_per_s": round(n / wall, 1), "wall_s": round(wall, 3),
                                      "output_tokens": n}
        info = engine.get_server_info()
        row["info"] = {k: info.get(k) for k in ("attention_backend", "overlap", "forward_idle_fraction", "dtype",
                                                 "max_total_num_tokens", "device")}
    except Exception as e:  # one broken configuration must not hide the others' results
        row["error"] = f"{type(e).__name__}: {str(e)[-2000:]}"
    finally:
        engine.shutdown()
    return row


def agreement(rows: list[dict]) -> list[dict]:
    out = []
    for dtype in sorted({r["dtype"] for r in rows}):
        ref = next((r for r in rows if r["dtype"] == dtype and r["backend"] == "torch_native"
                    and not r["overlap"] and "check_outputs" in r), None)
        if ref is None:
            continue
        for r in rows:
            if r["dtype"] != dtype or "check_outputs" not in r:
                continue
            same = sum(a == b for a, b in zip(r["check_outputs"], ref["check_outputs"]))
            prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
                      for a, b in zip(r["check_outputs"], ref["check_outputs"])]
            out.append({"dtype": dtype, "backend": r["backend"], "overlap": r["overlap"],
                        "identical_outputs": f"{same}/{len(ref['check_outputs'])}",
                        "min_common_prefix_tokens": min(prefix)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--backends", default="torch_native,triton,flashinfer")
    ap.add_argument("--batches", default="1,32,256")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script itself (tiny settings)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import torch

    from radixlm.srt.weights.loader import load_tokenizer, resolve_model_path

    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_engine.py needs a CUDA device")
    model_path = resolve_model_path(args.model_path)
    tok = load_tokenizer(model_path)
    batches = sorted({int(b) for b in args.batches.split(",")} | {CHECK_PROMPTS})
    prompts = {b: make_prompts(tok, b) for b in batches}
    backends = args.backends.split(",")
    skipped = {b: f"{NEEDS[b]} not installed" for b in backends
               if b in NEEDS and importlib.util.find_spec(NEEDS[b]) is None}
    rows = []
    for dtype in args.dtypes.split(","):
        for backend in backends:
            if backend in skipped or (backend == "flashinfer" and dtype == "float32"):
                continue  # flashinfer's kernels are fp16/bf16 only
            for overlap in (False, True):
                rows.append(run_config(args.model_path, args.device, dtype, backend, overlap, prompts, args.output_len))
                r = rows[-1]
                print(f"{dtype} {backend} overlap={overlap}: {r.get('error') or r['batches']} "
                      f"idle={r.get('info', {}).get('forward_idle_fraction')}", file=sys.stderr, flush=True)
    result = {"benchmark": "gpu_engine", "model_path": model_path, "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
              "output_len": args.output_len, "skipped": skipped, "agreement": agreement(rows),
              "runs": [{k: v for k, v in r.items() if k != "check_outputs"} for r in rows]}
    emit(result, args.out)


if __name__ == "__main__":
    main()
