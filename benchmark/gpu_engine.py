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
               prompts: dict[int, list], output_len: int, max_running: int | None = None) -> dict:
    from radixlm import Engine

    row: dict = {"dtype": dtype, "backend": backend, "overlap": overlap}
    t0 = time.perf_counter()
    try:
        engine = Engine(model_path=model_path, device=device, dtype=dtype, attention_backend=backend,
                        enable_overlap_schedule=overlap, disable_overlap_schedule=not overlap,
                        max_running_requests=max_running or max(prompts))
    except Exception as e:  # one broken configuration must not hide the others' results
        row["error"] = f"start: {type(e).__name__}: {str(e)[-2000:]}"
        return row
    row["load_s"] = round(time.perf_counter() - t0, 2)
    try:
        check = prompts[CHECK_PROMPTS][:CHECK_PROMPTS]
        outs = engine.generate(input_ids=check, sampling_params={"max_new_tokens": CHECK_TOKENS, "temperature": 0.0})
        row["check_outputs"] = [o["output_ids"] for o in outs]
        reasons = [str((o.get("meta_info") or {}).get("finish_reason", {}).get("type")) for o in outs]
        row["check_finish_reasons"] = {k: reasons.count(k) for k in sorted(set(reasons))}
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
    """Each run's check outputs against its dtype's reference (torch_native with overlap off,
    else the first run that finished), and each backend's overlap-on run against its
    overlap-off run."""
    out = []
    done = [r for r in rows if "check_outputs" in r and "error" not in r]
    for dtype in sorted({r["dtype"] for r in done}):
        runs = [r for r in done if r["dtype"] == dtype]
        ref = next((r for r in runs if r["backend"] == "torch_native" and not r["overlap"]), runs[0])
        for r in runs:
            pair = next((o for o in runs if o["backend"] == r["backend"] and not o["overlap"]), None)
            row = {"dtype": dtype, "backend": r["backend"], "overlap": r["overlap"],
                   "reference": f"{ref['backend']} overlap={ref['overlap']}", **_compare(r, ref)}
            if r["overlap"] and pair is not None:
                row["vs_overlap_off"] = _compare(r, pair)["identical_outputs"]
            out.append(row)
    return out


def _compare(run: dict, ref: dict) -> dict:
    a_all, b_all = run["check_outputs"], ref["check_outputs"]
    same = sum(a == b for a, b in zip(a_all, b_all))
    first_diff = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)) if len(a) != len(b)
                       else None) for a, b in zip(a_all, b_all)]
    diverged = [i for i in first_diff if i is not None]
    return {"identical_outputs": f"{same}/{len(b_all)}",
            "earliest_divergence_token": min(diverged) if diverged else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--backends", default="torch_native,triton,flashinfer")
    ap.add_argument("--batches", default="1,32,256")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-running-requests", type=int, default=None, help="default: the largest batch")
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
                rows.append(run_config(args.model_path, args.device, dtype, backend, overlap, prompts, args.output_len,
                                       args.max_running_requests))
                r = rows[-1]
                if args.out:  # what finished survives a run cut short by its time limit
                    emit({"benchmark": "gpu_engine", "partial": True, "agreement": agreement(rows),
                          "runs": [{k: v for k, v in x.items() if k != "check_outputs"} for x in rows]},
                         args.out, quiet=True)
                print(f"{dtype} {backend} overlap={overlap}: {r.get('error') or r['batches']} "
                      f"idle={r.get('info', {}).get('forward_idle_fraction')}", file=sys.stderr, flush=True)
    result = {"benchmark": "gpu_engine", "model_path": model_path, "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
              "output_len": args.output_len, "skipped": skipped, "agreement": agreement(rows),
              "runs": [{k: v for k, v in r.items() if k != "check_outputs"} for r in rows]}
    emit(result, args.out)


if __name__ == "__main__":
    main()
