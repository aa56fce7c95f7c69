"""What every engine runner of the benchmarks shares: the spec in, the result out, and the
throughput / latency figures computed the same way for radixlm and each peer.

Standard library only: the peer runners import it from their own venvs (their directory is
on sys.path), the radixlm-side scripts as `peers.peer_io`.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Callable


def read_spec() -> tuple[dict, str | None]:
    """(spec, result path or None) from `runner.py SPEC.json [RESULT.json]`."""
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    return spec, (sys.argv[2] if len(sys.argv) > 2 else None)


def spec_prompts(spec: dict) -> list[list[int]]:
    """The prompts to run: all of them for "generate" and "rounds", the one prompt for "latency"."""
    return spec["prompts"] if spec["mode"] in ("generate", "rounds") else [spec["prompt"]]


def throughput_fields(prompts: list[list[int]], output_tokens: int, wall: float) -> dict:
    return {"wall_s": round(wall, 3), "output_tokens": output_tokens,
            "output_tok_per_s": round(output_tokens / wall, 1),
            "total_tok_per_s": round((output_tokens + sum(map(len, prompts))) / wall, 1)}


def cached_tokens_total(cached: list[int | None]) -> int | None:
    """Sum of per-request cached prompt tokens; None when the engine reports none at all."""
    return sum(c for c in cached if c) if any(c is not None for c in cached) else None


def time_first_and_full(generate: Callable[[int], int], output_len: int, repeats: int,
                        before_each: Callable[[], None] | None = None) -> tuple[list[float], list[float]]:
    """Wall times of `repeats` runs producing 1 token (TTFT) and output_len tokens;
    generate(n) returns how many tokens it produced, which must be n."""
    ttft: list[float] = []
    full: list[float] = []
    for _ in range(repeats):
        for n, acc in ((1, ttft), (output_len, full)):
            if before_each is not None:
                before_each()
            t0 = time.perf_counter()
            produced = generate(n)
            acc.append(time.perf_counter() - t0)
            assert produced == n, (produced, n)
    return ttft, full


def latency_fields(ttft: list[float], full: list[float], output_len: int) -> dict:
    t, f = statistics.median(ttft), statistics.median(full)
    return {"ttft_s": round(t, 4), "full_s": round(f, 3), "decode_ms_per_token": round(1000 * (f - t) / (output_len - 1), 2),
            "ttft_runs_s": [round(x, 4) for x in ttft], "full_runs_s": [round(x, 3) for x in full]}


def serve_rounds(out_path: str, info: dict, run_once: Callable[[], dict]) -> None:
    """Rounds mode (benchmark/peer_rounds.py): the engine stays loaded; `info` goes to
    OUT.ready, then each stdin line `run K` runs the workload once into OUT.roundK, until
    `quit` or the end of stdin. Files appear whole (written, then renamed)."""
    _write_atomic(out_path + ".ready", info)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "quit":
            break
        if cmd[0] == "run":
            _write_atomic(f"{out_path}.round{cmd[1]}", run_once())


def _write_atomic(path: str, obj: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f)
    os.replace(path + ".tmp", path)


def write_result(result: dict, out_path: str | None) -> None:
    """To RESULT.json (if given) and, last, to stdout."""
    text = json.dumps(result)
    if out_path:
        with open(out_path, "w") as f:
            f.write(text)
    print(text)
    sys.stdout.flush()
