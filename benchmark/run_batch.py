"""`radixlm run-batch` against `Engine.generate` on the same prompts; prints one JSON object.

    python benchmark/run_batch.py [--model-path P] [--num-prompts 64] [--output-len 64] [--rounds 3] [--out F.json]

Both run on one Engine, in turns (engine, batch, engine, batch, ...), so the machine's drift
during the run falls on both alike: `Engine.generate(prompts)` with the chat template applied
to each prompt, and the run-batch path (each prompt a /v1/chat/completions line of an OpenAI
Batch file, handled by the server's OpenAI code and written to a JSONL file as it finishes).
Greedy, EOS ignored, exactly --output-len tokens each, so both generate the same tokens.
`ratio` is run-batch's output tokens/s over Engine.generate's (medians of the rounds); the
target is >= 0.9.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import emit  # noqa: E402

TOPICS = ["the history of Rome", "how vaccines work", "black holes", "photosynthesis", "machine learning",
          "the water cycle", "plate tectonics", "coral reefs"]
STYLES = ["Explain {} to a child.", "Write a short essay about {}.", "List five facts about {}.",
          "Summarize what is known about {}."]


def questions(n: int) -> list[str]:
    return [STYLES[i % len(STYLES)].format(TOPICS[(i // len(STYLES)) % len(TOPICS)]) + f" (#{i})" for i in range(n)]


def batch_file(path: str, qs: list[str], output_len: int) -> None:
    with open(path, "w") as f:
        for i, q in enumerate(qs):
            body = {"messages": [{"role": "user", "content": q}], "max_tokens": output_len, "temperature": 0,
                    "ignore_eos": True}
            f.write(json.dumps({"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": body}) + "\n")


def run_engine(engine, prompts: list[str], output_len: int) -> tuple[float, int]:
    t0 = time.perf_counter()
    outs = engine.generate(prompts, {"max_new_tokens": output_len, "temperature": 0, "ignore_eos": True})
    seconds = time.perf_counter() - t0
    return seconds, sum(o["meta_info"]["completion_tokens"] for o in outs)


def run_batch(engine, in_path: str, out_path: str) -> tuple[float, int]:
    from radixlm.srt.cli.main import build_parser
    from radixlm.srt.cli.run_batch import ResumeState, _run_on_loop

    ns = build_parser().parse_args(["run-batch", "-i", in_path, "-o", out_path])
    with open(in_path) as f, open(out_path, "w") as out:
        t0 = time.perf_counter()
        summary = engine.run_coroutine(_run_on_loop(engine, ns, f, ResumeState(set(), 0), [0], out))
        seconds = time.perf_counter() - t0
    if summary.failed:
        raise RuntimeError(f"{summary.failed} batch lines failed: see {out_path}")
    return seconds, summary.completion_tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from radixlm.srt.engine import Engine

    qs = questions(args.num_prompts)
    work = tempfile.mkdtemp(prefix="radixlm-bench-batch-")
    in_path, out_path = os.path.join(work, "in.jsonl"), os.path.join(work, "out.jsonl")
    batch_file(in_path, qs, args.output_len)
    rates: dict[str, list[float]] = {"engine_generate": [], "run_batch": []}
    with Engine(model_path=args.model_path, dtype=args.dtype) as engine:
        prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                        add_generation_prompt=True) for q in qs]
        run_engine(engine, prompts[:4], 4)  # warm-up: kernels, first allocations
        for _ in range(args.rounds):
            engine.flush_cache()
            s, toks = run_engine(engine, prompts, args.output_len)
            rates["engine_generate"].append(toks / s)
            engine.flush_cache()
            s, toks = run_batch(engine, in_path, out_path)
            rates["run_batch"].append(toks / s)
        model_path = engine.tokenizer_manager.model_path
    medians = {k: statistics.median(v) for k, v in rates.items()}
    emit({"benchmark": "run_batch", "model": os.path.basename(model_path.rstrip("/")),
          "workload": {"num_prompts": args.num_prompts, "output_len": args.output_len, "rounds": args.rounds,
                       "sampling": "greedy, EOS ignored", "api": "chat completions"},
          "output_tok_s": {k: [round(x, 1) for x in v] for k, v in rates.items()},
          "median_output_tok_s": {k: round(v, 1) for k, v in medians.items()},
          "ratio": round(medians["run_batch"] / medians["engine_generate"], 3), "target_ratio": 0.9}, args.out)


if __name__ == "__main__":
    main()
