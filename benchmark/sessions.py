"""Multi-turn chat with sessions (the KV a session holds) vs the radix prefix cache alone.

    python benchmark/sessions.py [--model-path DIR] [--conversations 16] [--turns 6]
        [--system-len 256] [--user-len 24] [--output-len 32] [--out benchmark/results/sessions_{cpu}.json]

`--conversations` conversations run at once (each one's turns one after another). A
conversation's first turn is its own context (`--system-len` token ids) plus a user message;
every turn appends a user message (`--user-len` token ids, fixed by `--seed`) to the history and
generates `--output-len` tokens (greedy, EOS ignored). The same workload runs in two modes, each
on a fresh in-process Engine with the same settings:
- tree: each turn resends the whole history as a plain request; the radix prefix cache matches
  what it holds of it;
- session: one session per conversation (docs/semantics.md §15), its capacity the whole
  conversation; each turn sends only its new message with session_params naming the previous
  turn's rid, and takes over the KV the session holds instead of matching the tree.
Reported per mode: TTFT (submission to the first streamed chunk with tokens) p50 / p99 over the
conversations for each turn index, mean cached_tokens per turn index, output tok/s over the
whole run, the prompt tokens the engine computed, and whether the greedy outputs of the two modes
are identical. Percentiles are nearest-rank.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import emit  # noqa: E402

MODES = ("tree", "session")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, max(0, int(round(q * len(xs))) - 1))], 4)


def build_workload(args) -> list[list[list[int]]]:
    """messages[conversation][turn] (token ids); turn 0 carries the conversation's own context."""
    rng = random.Random(args.seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(100, args.vocab) for _ in range(n)]

    return [[ids(args.system_len + args.user_len if t == 0 else args.user_len) for t in range(args.turns)]
            for _ in range(args.conversations)]


async def one_turn(engine, ids: list[int], sp: dict, rid: str, session_params: dict | None
                   ) -> tuple[list[int], float, dict]:
    """(output ids, TTFT, last meta_info) of one streamed turn."""
    t0 = time.perf_counter()
    ttft = None
    out: list[int] = []
    meta: dict = {}
    agen = await engine.async_generate(input_ids=ids, sampling_params=sp, stream=True, rid=rid,
                                       session_params=session_params)
    async for chunk in agen:
        if ttft is None and chunk["output_ids"]:
            ttft = time.perf_counter() - t0
        out.extend(chunk["output_ids"])
        meta = chunk["meta_info"]
    return out, ttft if ttft is not None else time.perf_counter() - t0, meta


async def conversation(engine, mode: str, c: int, messages: list[list[int]], sp: dict,
                       session_id: str | None) -> list[tuple[list[int], float, dict]]:
    history: list[int] = []
    prev_rid: str | None = None
    turns = []
    for t, msg in enumerate(messages):
        rid = f"{mode}-c{c}-t{t}"
        if mode == "session":
            params = {"id": session_id, **({"rid": prev_rid} if prev_rid else {})}
            out, ttft, meta = await one_turn(engine, msg, sp, rid, params)
        else:
            out, ttft, meta = await one_turn(engine, history + msg, sp, rid, None)
        history = history + msg + out
        prev_rid = rid
        turns.append((out, ttft, meta))
    return turns


def run_mode(args, mode: str, workload: list[list[list[int]]]) -> tuple[dict, list[list[int]]]:
    from radixlm import Engine

    sp = {"max_new_tokens": args.output_len, "temperature": 0.0, "ignore_eos": True}
    # the whole conversation: every turn's prompt (the history plus its message) fits
    capacity = args.system_len + args.turns * (args.user_len + args.output_len)
    kw = {"max_running_requests": args.max_running} if args.max_running else {}
    engine = Engine(model_path=args.model_path, dtype=args.dtype, **kw)
    try:
        engine.generate(input_ids=[100, 101, 102], sampling_params={"max_new_tokens": 2})  # warm-up
        base = engine.get_server_info()
        sids = [engine.open_session(capacity) if mode == "session" else None for _ in workload]

        async def drive():
            return await asyncio.gather(*(conversation(engine, mode, c, msgs, sp, sids[c])
                                          for c, msgs in enumerate(workload)))

        t0 = time.perf_counter()
        convs = asyncio.run(drive())
        wall = time.perf_counter() - t0
        info = engine.get_server_info()
        for sid in sids:
            if sid is not None:
                engine.close_session(sid)
    finally:
        engine.shutdown()
    out_tokens = sum(len(out) for turns in convs for out, _, _ in turns)
    per_turn = []
    for t in range(args.turns):
        ttfts = [turns[t][1] for turns in convs]
        metas = [turns[t][2] for turns in convs]
        per_turn.append({"turn": t, "ttft_p50_s": pct(ttfts, 0.5), "ttft_p99_s": pct(ttfts, 0.99),
                         "mean_prompt_tokens": round(statistics.fmean(m.get("prompt_tokens", 0) for m in metas), 1),
                         "mean_cached_tokens": round(statistics.fmean(m.get("cached_tokens", 0) for m in metas), 1)})
    all_ttfts = [ttft for turns in convs for _, ttft, _ in turns]
    result = {"wall_s": round(wall, 3), "output_tokens": out_tokens,
              "output_tok_per_s": round(out_tokens / wall, 2),
              "ttft_p50_s": pct(all_ttfts, 0.5), "ttft_p99_s": pct(all_ttfts, 0.99),
              "prompt_tokens_computed": (info.get("num_prefill_tokens") or 0) - (base.get("num_prefill_tokens") or 0),
              "per_turn": per_turn}
    if mode == "session":
        result["session_capacity_tokens"] = capacity
        result["sessions"] = info.get("sessions")
    return result, [out for turns in convs for out, _, _ in turns]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-running", type=int, default=None, help="max_running_requests (the Engine's default)")
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system-len", type=int, default=256, help="token ids of each conversation's own context")
    ap.add_argument("--user-len", type=int, default=24, help="token ids of each user message")
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=30000, help="token ids are drawn below this")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--out", default=None, help="also write the JSON here ({cpu}: this processor's kind)")
    args = ap.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        ap.error(f"--modes: choose from {', '.join(MODES)}")
    for name in ("conversations", "turns", "user_len", "output_len"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.system_len < 0 or args.vocab <= 100:
        ap.error("--system-len must be >= 0 and --vocab > 100")

    workload = build_workload(args)
    results, outputs = {}, {}
    for mode in modes:
        results[mode], outputs[mode] = run_mode(args, mode, workload)
    report: dict = {"workload": {k: getattr(args, k) for k in ("conversations", "turns", "system_len", "user_len",
                                                                "output_len", "dtype", "max_running", "vocab", "seed")},
                    "modes": results}
    if len(outputs) == 2:
        tree, session = outputs["tree"], outputs["session"]
        report["outputs_identical"] = tree == session
        # bf16 numerics depend on batch shapes, so a greedy near-tie may flip between modes;
        # how many turns agree says how far
        report["outputs_agreeing"] = f"{sum(a == b for a, b in zip(tree, session))}/{len(tree)}"
    emit(report, args.out)


if __name__ == "__main__":
    main()
