"""Tensor parallelism at tp 1 vs tp 2 on the default model, and the time of a full weight
broadcast from a trainer process; prints one JSON object.

    python benchmark/tensor_parallel.py [--runs 1,1x1,2] [--num 32] [--prompt-len 32] [--output-len 64]
                                        [--dtype float32] [--model-path P] [--out F.json]

Runs: "N" is tp N with the machine's threads split between the ranks; "NxT" is tp N with T
threads per rank (1x1: one rank on one thread, the same per-rank resources as tp 2 on two
cores, which separates TP's own cost from thread scaling). Per run (an Engine with real rank
processes):
  offline_tok_per_s     output tokens/s of --num greedy requests submitted together
  step_ms_batch         wall time per scheduler step of that run (decode-dominated)
  step_ms_batch1        ms per step of one request alone (one token per step)
  weight_broadcast_s    one update_weights_from_distributed of every tensor of the model
                        (all ~135M parameters, float32) from a trainer process over gloo,
                        received whole by every rank, cut to its shard and applied
  outputs_identical_to_first   requests whose greedy tokens equal the first run's (float32)
On a 2-core machine tp 2 cannot be faster: the two ranks share the cores tp 1 already uses,
and every decode step adds ~64 collectives (2 all-reduces per layer, the embedding, the
logits gather, the control broadcast and the batch check) at tens of microseconds each.
"""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import emit  # noqa: E402


def trainer_main(init_method: str, world_size: int, model_path: str) -> None:
    """--trainer mode: join the group as rank 0 and broadcast the model's every tensor."""
    import torch.distributed as dist

    from radixlm.srt.distributed.weight_sync import broadcast_weights, init_custom_process_group
    from radixlm.srt.weights.loader import iter_weights, load_model_config, resolve_model_path
    path = resolve_model_path(model_path)
    named = list(iter_weights(path, load_model_config(path)))
    group = init_custom_process_group("gloo", init_method, world_size, 0, "bench")
    print("ready", flush=True)
    broadcast_weights(group, named)
    dist.destroy_process_group(group)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(spec: str, args) -> tuple[dict, list[list[int]]]:
    tp, _, threads = spec.partition("x")
    tp = int(tp)
    saved = os.environ.get("RADIXLM_NUM_THREADS")
    if threads:
        os.environ["RADIXLM_NUM_THREADS"] = threads  # read by the rank processes at start-up
    try:
        return _run(tp, args)
    finally:
        os.environ.pop("RADIXLM_NUM_THREADS", None)
        if saved is not None:
            os.environ["RADIXLM_NUM_THREADS"] = saved


def _run(tp: int, args) -> tuple[dict, list[list[int]]]:
    from radixlm import Engine
    from radixlm.srt.weights.loader import iter_weights, load_model_config, resolve_model_path

    prompts = [[(37 * i + 11 * j) % 40000 + 100 for j in range(args.prompt_len)] for i in range(args.num)]
    greedy = {"temperature": 0, "ignore_eos": True}
    t0 = time.perf_counter()
    eng = Engine(model_path=args.model_path, dtype=args.dtype, tp_size=tp)
    try:
        startup = time.perf_counter() - t0
        eng.generate(input_ids=prompts[:2], sampling_params={"max_new_tokens": 4, **greedy})  # warm-up
        eng.flush_cache()

        def timed(batch: list[list[int]], n: int) -> tuple[float, int, list]:
            steps0 = eng.get_server_info()["num_steps"]
            t = time.perf_counter()
            outs = eng.generate(input_ids=batch, sampling_params={"max_new_tokens": n, **greedy})
            wall = time.perf_counter() - t
            eng.flush_cache()
            return wall, eng.get_server_info()["num_steps"] - steps0, outs

        wall1, steps1, _ = timed(prompts[:1], args.output_len)
        wall, steps, outs = timed(prompts, args.output_len)
        path = resolve_model_path(args.model_path)
        named = list(iter_weights(path, load_model_config(path)))
        names, dtypes = [n for n, _ in named], [str(t.dtype) for _, t in named]
        shapes = [list(t.shape) for _, t in named]
        n_bytes = sum(t.numel() * t.element_size() for _, t in named)
        del named
        port = _free_port()
        trainer = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--trainer", f"tcp://127.0.0.1:{port}",
                                    str(tp + 1), args.model_path or ""], stdout=subprocess.PIPE, text=True)
        eng.init_weights_update_group("127.0.0.1", port, 1, tp + 1, "bench", "gloo")
        trainer.stdout.readline()  # "ready": the trainer holds every tensor and starts broadcasting
        t = time.perf_counter()
        res = eng.update_weights_from_distributed(names, dtypes, shapes, group_name="bench")
        broadcast = time.perf_counter() - t
        if trainer.wait(120) != 0:
            raise RuntimeError("the trainer failed")
        eng.destroy_weights_update_group("bench")
        ids = [o["output_ids"] for o in outs]
        return {"tp_size": tp, "threads_per_rank": eng.get_server_info()["threads_per_rank"],
                "startup_s": round(startup, 1),
                "offline_tok_per_s": round(args.num * args.output_len / wall, 1),
                "step_ms_batch": round(1000 * wall / max(steps, 1), 2), "steps_batch": steps,
                "step_ms_batch1": round(1000 * wall1 / max(steps1, 1), 2),
                "weight_broadcast_s": round(broadcast, 2), "weight_broadcast_tensors": res["num_tensors"],
                "weight_broadcast_gb": round(n_bytes / 1e9, 3),
                "weight_broadcast_gb_per_s": round(n_bytes / 1e9 / broadcast, 3)}, ids
    finally:
        eng.shutdown()


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--trainer":
        trainer_main(sys.argv[2], int(sys.argv[3]), sys.argv[4] or None)
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default="1,1x1,2", help="comma-separated runs: N (tp N) or NxT (tp N, T threads "
                                                       "per rank); the first is the reference")
    ap.add_argument("--num", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    results, reference = [], None
    for spec in args.runs.split(","):
        row, ids = run(spec.strip(), args)
        if reference is None:
            reference = ids
        row["outputs_identical_to_first"] = f"{sum(a == b for a, b in zip(ids, reference))}/{len(ids)}"
        results.append(row)
    emit({"benchmark": "tensor_parallel", "model": args.model_path or "default (SmolLM2-135M-Instruct Q4_1 GGUF)",
          "dtype": args.dtype, "num": args.num, "prompt_len": args.prompt_len, "output_len": args.output_len,
          "results": results,
          "note": "2-core machine: the ranks share the cores tp 1 uses and each decode step adds ~64 "
                  "collectives; no gain is possible here (tp pays off with a device or socket per rank)"},
         args.out)


if __name__ == "__main__":
    main()
