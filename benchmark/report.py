"""The README's benchmark table and the plot, regenerated from benchmark/results/.

    python benchmark/report.py           # rewrite the table in README.md, redraw the plot (needs matplotlib)
    python benchmark/report.py --check   # exit 1 when README.md's table is not what the files say
    python benchmark/report.py --print   # the table on stdout

The table sits in README.md between the two marker comments below. Each row names one result
file (`<workload>_<cpu kind>.json`, the newest run of that workload on that kind of processor,
see common.results_path) and the command that wrote it; the numbers are read from the file,
never typed, so rerunning a benchmark and then this script is how the README's numbers change.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(BENCH_DIR, "results")
README = os.path.join(os.path.dirname(BENCH_DIR), "README.md")
START, END = "<!-- benchmark-table:start -->", "<!-- benchmark-table:end -->"
PEERS = (("vllm", "vLLM-CPU"), ("llamacpp", "llama.cpp"))
CPU_NAMES = {"zen4": "Zen 4", "zen3": "Zen 3", "amx": "Xeon AMX"}

OFFLINE = "python benchmark/offline_throughput.py --num-prompts 32 --dtype bfloat16"
PREFILL = "python benchmark/prefill.py --repeats 3 --dtype bfloat16"
W8A8_KV8 = "--quantization w8a8_int8 --kv-cache-dtype int8"


@dataclass(frozen=True)
class Row:
    """One line of the table: what `metric` of `results/<file>.json` (one `case` of it) says."""
    file: str
    workload: str
    metric: str  # output_tok_per_s | prompt_tok_per_s | decode_ms_per_token | serving_tok_per_s | itl_p99_ms
    command: str
    case: str | None = None


ROWS = (
    Row("offline_32x128_bf16_zen4", "32 chat prompts x 128 new tokens, bf16", "output_tok_per_s",
        f"{OFFLINE} --output-len 128 --peer vllm"),
    Row("offline_32x128_w8a8_kvint8_zen4", "the same, radixlm w8a8 + int8 KV (peers bf16)", "output_tok_per_s",
        f"{OFFLINE} --output-len 128 {W8A8_KV8} --peer vllm"),
    Row("offline_32x1024_w8a8_kvint8_zen4", "32 chat prompts x 1,024 new tokens, w8a8 + int8 KV",
        "output_tok_per_s", f"{OFFLINE} --output-len 1024 {W8A8_KV8} --peer vllm,llamacpp"),
    Row("prefill_2k_bf16_zen4", "one 2,048-token prompt, bf16", "prompt_tok_per_s",
        f"{PREFILL} --cases single_2k --peer vllm", "single_2k"),
    Row("prefill_8k_bf16_zen4", "one 8,000-token prompt, bf16", "prompt_tok_per_s",
        f"{PREFILL} --cases single_8k --peer vllm", "single_8k"),
    Row("prefill_8x2k_bf16_zen4", "eight concurrent 2,048-token prompts, bf16", "prompt_tok_per_s",
        f"{PREFILL} --cases single_2k,concurrent_8x2k --peer vllm", "concurrent_8x2k"),
    Row("latency_w8a8_kvint8_zen4", "one stream, 42-token prompt, w8a8 + int8 KV", "decode_ms_per_token",
        "python benchmark/latency.py --prompt-len 42 --output-len 128 --repeats 5 --dtype bfloat16 "
        f"{W8A8_KV8} --peer vllm,llamacpp"),
    Row("serving_curve_bf16_zen4", "HTTP serving, 32 concurrent chat streams, bf16", "serving_tok_per_s",
        "python benchmark/serving.py --launch --dataset chat --num-prompts 16,32,64,128,256,512 --output-len 128 "
        "--max-concurrency 1,8,32,64,128,256 --dtype bfloat16 --peer vllm", "32"),
    Row("prefill_interference_bf16_zen4", "16 streams decoding while an 8k prompt prefills", "itl_p99_ms",
        "python benchmark/prefill_interference.py --streams 16 --long-len 8000 --dtype bfloat16 --peer vllm"),
    Row("offline_32x128_bf16_amx", "32 chat prompts x 128 new tokens, bf16", "output_tok_per_s",
        f"{OFFLINE} --output-len 128 --peer vllm"),
    Row("offline_32x128_w8a8_kvint8_amx", "the same, radixlm w8a8 + int8 KV (peers bf16)", "output_tok_per_s",
        f"{OFFLINE} --output-len 128 {W8A8_KV8} --peer vllm"),
    Row("prefill_bf16_amx", "one 2,048-token prompt, bf16", "prompt_tok_per_s", f"{PREFILL} --peer vllm",
        "single_2k"),
    Row("prefill_bf16_amx", "one 8,000-token prompt, bf16", "prompt_tok_per_s", f"{PREFILL} --peer vllm",
        "single_8k"),
    Row("prefill_bf16_amx", "eight concurrent 2,048-token prompts, bf16", "prompt_tok_per_s",
        f"{PREFILL} --peer vllm", "concurrent_8x2k"),
    Row("offline_32x128_bf16_zen3", "32 chat prompts x 128 new tokens, bf16", "output_tok_per_s",
        f"{OFFLINE} --output-len 128 --repeats 3 --peer vllm"),
    Row("offline_32x1024_w8a8_kvint8_zen3", "32 chat prompts x 1,024 new tokens, w8a8 + int8 KV",
        "output_tok_per_s", f"{OFFLINE} --output-len 1024 {W8A8_KV8} --peer llamacpp,vllm"),
    Row("prefill_2k_w8a8_zen3", "one 2,048-token prompt, w8a8", "prompt_tok_per_s",
        f"{PREFILL} --quantization w8a8_int8 --peer vllm,llamacpp", "single_2k"),
)
UNITS = {"output_tok_per_s": "output tok/s", "prompt_tok_per_s": "prompt tok/s",
         "decode_ms_per_token": "decode ms/token", "serving_tok_per_s": "output tok/s",
         "itl_p99_ms": "stream ITL p99, ms"}
LOWER_IS_BETTER = {"decode_ms_per_token", "itl_p99_ms"}


def load(name: str) -> dict:
    with open(os.path.join(RESULTS, f"{name}.json")) as f:
        return json.load(f)


def value(result: dict, row: Row, engine: str) -> float | None:
    """`row.metric` of `engine` in a result file, None when that engine did not run."""
    if row.metric == "prompt_tok_per_s":
        entry = result.get(row.case or "", {}).get(engine)
        return entry.get("prompt_tok_per_s") if isinstance(entry, dict) else None
    entry = result.get(engine)
    if not isinstance(entry, dict) or "error" in entry:
        return None
    if row.metric == "serving_tok_per_s":
        runs = [r for r in entry.get("runs", []) if str(r.get("max_concurrency")) == row.case]
        return runs[0]["output_token_throughput"] if runs else None
    if row.metric == "itl_p99_ms":
        return entry.get("during_prefill_itl_ms", {}).get("p99")
    return entry.get(row.metric)


def rounds(result: dict, row: Row) -> int:
    """The interleaved rounds the file was measured with (0: the engines one after the other)."""
    where = result.get(row.case or "", {}) if row.metric == "prompt_tok_per_s" else result
    inter = where.get("interleaved") if isinstance(where, dict) else None
    return int(inter["rounds"]) if isinstance(inter, dict) else 0


def file_ratio(result: dict, row: Row) -> float | None:
    """The speed-up over vLLM-CPU the benchmark itself computed (for interleaved rounds the
    median of the per-round ratios, which is not the ratio of the medians), None without one."""
    if row.metric == "prompt_tok_per_s":
        r = result.get(row.case or "", {}).get("speedup_vs_vllm")
    elif row.metric == "serving_tok_per_s":
        r = (result.get("speedup_vs_vllm") or {}).get(row.case or "")
    elif row.metric == "itl_p99_ms":
        r = result.get("p99_itl_ratio_vllm_over_radixlm")
    elif row.metric == "decode_ms_per_token":
        r = result.get("decode_speedup_vs_vllm")
    else:
        r = result.get("speedup_vs_vllm")
    return float(r) if isinstance(r, (int, float)) else None


def fmt(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:,.1f}" if x < 100 else f"{x:,.0f}"


def table_lines() -> list[str]:
    head = "| workload | metric | radixlm | " + " | ".join(n for _, n in PEERS) + " | vs vLLM | CPU | command |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for row in ROWS:
        result = load(row.file)
        ours = value(result, row, "radixlm")
        peers = [value(result, row, key) for key, _ in PEERS]
        vllm = peers[0]
        speedup = file_ratio(result, row)
        if speedup is None and ours and vllm:
            speedup = vllm / ours if row.metric in LOWER_IS_BETTER else ours / vllm
        ratio = "-" if speedup is None else f"**{speedup:.2f}x**"
        cpu = row.file.rsplit("_", 1)[1]
        n = rounds(result, row)
        command = row.command + (f" --interleave {n}" if n else "")
        lines.append(f"| {row.workload} | {UNITS[row.metric]} | {fmt(ours)} | "
                     + " | ".join(fmt(p) for p in peers)
                     + f" | {ratio} | {CPU_NAMES.get(cpu, cpu)} | `{command}` ({row.file}.json) |")
    return lines


def replace_table(readme: str, lines: list[str]) -> str:
    if START not in readme or END not in readme:
        raise SystemExit(f"README.md has no {START} ... {END} markers")
    before, rest = readme.split(START, 1)
    _, after = rest.split(END, 1)
    return before + START + "\n" + "\n".join(lines) + "\n" + END + after


def draw_plot() -> None:
    """benchmark/plot.py over the AVX-512 (Zen 4) and AMX files, where matplotlib is installed."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("matplotlib is not installed: the plot was not redrawn (pip install matplotlib)", file=sys.stderr)
        return
    for isa, png in (("avx512", "benchmarks.png"), ("amx", "benchmarks_amx.png")):
        subprocess.run([sys.executable, os.path.join(BENCH_DIR, "plot.py"), "--isa", isa,
                        "--out", os.path.join(RESULTS, png)], check=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="compare README.md's table with the files; exit 1 if stale")
    ap.add_argument("--print", action="store_true", help="print the table only")
    ap.add_argument("--readme", default=README)
    args = ap.parse_args(argv)
    lines = table_lines()
    if args.print:
        print("\n".join(lines))
        return 0
    with open(args.readme) as f:
        readme = f.read()
    updated = replace_table(readme, lines)
    if args.check:
        if updated != readme:
            print("README.md's benchmark table differs from benchmark/results/: run python benchmark/report.py",
                  file=sys.stderr)
            return 1
        return 0
    if updated != readme:
        with open(args.readme, "w") as f:
            f.write(updated)
    draw_plot()
    return 0


if __name__ == "__main__":
    sys.exit(main())
