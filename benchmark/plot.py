"""Plot the benchmark results: reads the JSON files under benchmark/results/ (or the files
given) and writes one PNG.

    python benchmark/plot.py [FILE.json ...] [--out benchmark/results/benchmarks.png] [--isa avx2|avx512|amx|any]

Panels, each drawn when some file has its data:
  - output tok/s per engine per offline workload (offline_throughput, prefix_sharing, ...);
  - single-stream latency: decode ms/token and TTFT per engine;
  - prefill (benchmark/prefill.py): prompt tok/s per engine per case (2k, 8k, 8 x 2k);
  - serving: output tok/s vs concurrency per engine, and inter-token / first-token latency
    percentiles (p50, p90, p99) vs concurrency.
Results from different processors are never mixed in one plot: --isa keeps the files measured
on an AMX CPU (amx), an AVX-512 one without AMX (avx512) or an AVX2-only one (avx2); the
default is the kind this machine is.
matplotlib is optional (not a radixlm dependency): `pip install matplotlib`.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
ENGINE_ORDER = ["radixlm", "radixlm-kv_int8", "radixlm-w8a8_int8", "radixlm-w8a8_int8-kv_int8", "vllm", "llamacpp",
                "hf"]
COLORS = {"radixlm": "tab:red", "radixlm-kv_int8": "tab:pink", "radixlm-w8a8_int8": "tab:orange",
          "radixlm-w8a8_int8-kv_int8": "tab:brown", "vllm": "tab:blue", "llamacpp": "tab:green", "hf": "tab:gray"}


def radixlm_key(entry: dict) -> str:
    """radixlm, plus -<quantization> and -kv_<dtype> for the opt-in modes of the run."""
    key = "radixlm"
    if entry.get("quantization"):
        key += f"-{entry['quantization']}"
    if entry.get("kv_cache_dtype") not in (None, "auto"):
        key += f"-kv_{entry['kv_cache_dtype']}"
    return key


def engines_of(result: dict) -> dict[str, dict]:
    """{key: entry} for every engine entry of a result (skipping peers that could not run); a
    radixlm run in an opt-in mode is keyed by radixlm_key."""
    out = {}
    for k, v in result.items():
        if isinstance(v, dict) and "engine" in v and "error" not in v:
            out[radixlm_key(v) if k == "radixlm" else k] = v
    return dict(sorted(out.items(), key=lambda kv: ENGINE_ORDER.index(kv[0]) if kv[0] in ENGINE_ORDER else 99))


def serving_runs(result: dict) -> dict[str, list[dict]]:
    """{engine: [run report, ...]} of a serving result (the flat single-run report included)."""
    if "output_token_throughput" in result:  # flat report: radixlm alone, one concurrency
        return {"radixlm": [result]}
    return {k: v["runs"] for k, v in engines_of(result).items() if v.get("runs")}


def prefill_rows(name: str, result: dict) -> list[tuple[str, dict]]:
    """One bar group per case of a prefill result: {engine: prompt tok/s}."""
    rows = []
    for case, entries in result.items():
        if not isinstance(entries, dict) or "radixlm" not in entries:
            continue
        rows.append((f"{name}: {case}", {radixlm_key(e) if k == "radixlm" else k: e.get("prompt_tok_per_s")
                                          for k, e in entries.items() if isinstance(e, dict) and "error" not in e}))
    return rows


def classify(result: dict) -> str:
    if "output_token_throughput" in result or result.get("benchmark") == "serving":
        return "serving"
    if result.get("benchmark") == "prefill":
        return "prefill"
    ours = result.get("radixlm", {})
    if "decode_ms_per_token" in ours:
        return "latency"
    if "output_tok_per_s" in ours:
        return "throughput"
    return "unknown"


def load(paths: list[str]) -> list[tuple[str, dict]]:
    out = []
    for p in paths:
        try:
            with open(p) as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            print(f"skipping {p}: {e}", file=sys.stderr)
            continue
        if isinstance(data, dict):
            out.append((os.path.splitext(os.path.basename(p))[0], data))
    return out


def kind_of(isa) -> str:
    """amx, avx512 or avx2: an AMX CPU's bf16 kernels run on tiles (docs/performance.md),
    so its results are kept apart from the AVX-512 ones."""
    return "amx" if "amx_bf16" in isa else "avx512" if "avx512f" in isa else "avx2"


def isa_kind(machine: dict | None) -> str | None:
    """The kind of CPU (kind_of) a result was measured on, from its machine description (None
    when it has none)."""
    if not machine or "isa" not in machine:
        return None
    return kind_of(machine["isa"])


def this_isa() -> str:
    from radixlm.kernels.cpu.cpuinfo import cpu_flags
    return kind_of(cpu_flags())


def conc_label(c) -> str:
    return "all" if c is None else str(c)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="*", help=f"result JSON files (default: {RESULTS}/*.json)")
    ap.add_argument("--out", default=os.path.join(RESULTS, "benchmarks.png"))
    ap.add_argument("--isa", choices=("avx2", "avx512", "amx", "any"), default=None,
                    help="plot the results of this kind of CPU only (default: this machine's)")
    args = ap.parse_args()
    isa = args.isa or this_isa()
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("benchmark/plot.py needs matplotlib (not a radixlm dependency): pip install matplotlib")

    results = load(args.files or sorted(glob.glob(os.path.join(RESULTS, "*.json"))))
    if isa != "any":
        results = [(n, r) for n, r in results if isa_kind(r.get("machine")) == isa]
    groups: dict[str, list[tuple[str, dict]]] = {"throughput": [], "latency": [], "prefill": [], "serving": []}
    for name, r in results:
        kind = classify(r)
        if kind in groups:
            groups[kind].append((name, r))
    panels = []
    if groups["throughput"]:
        panels.append("throughput")
    if groups["latency"]:
        panels.append("latency")
    if groups["prefill"]:
        panels.append("prefill")
    if groups["serving"]:
        panels += ["serving_tput", "serving_itl", "serving_ttft"]
    if not panels:
        raise SystemExit("no benchmark results to plot")

    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 3.8 * len(panels)), squeeze=False)
    machine = next((r.get("machine") for _, r in results if r.get("machine")), None)
    title = "radixlm and its peers"
    if machine:
        title += f" - {machine.get('cpu', '?')}, {machine.get('cpus', '?')} CPUs, torch {machine.get('torch', '?')}"
    fig.suptitle(title, fontsize=11)
    for ax, panel in zip(axes[:, 0], panels):
        if panel == "throughput":
            bars(ax, [(name, {k: e.get("output_tok_per_s") for k, e in engines_of(r).items()})
                      for name, r in groups["throughput"]], "output tok/s (higher is better)")
        elif panel == "latency":
            rows = []
            for name, r in groups["latency"]:
                eng = engines_of(r)
                rows.append((f"{name}: decode ms/token", {k: e.get("decode_ms_per_token") for k, e in eng.items()}))
                rows.append((f"{name}: TTFT ms", {k: (e["ttft_s"] * 1e3 if e.get("ttft_s") is not None else None)
                                                  for k, e in eng.items()}))
            bars(ax, rows, "single stream, ms (lower is better)")
        elif panel == "prefill":
            bars(ax, [row for name, r in groups["prefill"] for row in prefill_rows(name, r)],
                 "prompt tok/s (higher is better)")
        else:
            serving(ax, panel, groups["serving"])
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(args.out)


def bars(ax, rows: list[tuple[str, dict]], ylabel: str) -> None:
    engines = [e for e in ENGINE_ORDER if any(v.get(e) is not None for _, v in rows)]
    engines += sorted({e for _, v in rows for e in v if v.get(e) is not None} - set(engines))
    width = 0.8 / max(len(engines), 1)
    for i, eng in enumerate(engines):
        xs = [j + (i - (len(engines) - 1) / 2) * width for j in range(len(rows))]
        ys = [v.get(eng) or 0 for _, v in rows]
        b = ax.bar(xs, ys, width, label=eng, color=COLORS.get(eng))
        ax.bar_label(b, labels=[f"{y:.1f}" if y else "" for y in ys], fontsize=7)
    ax.set_xticks(range(len(rows)), [name for name, _ in rows], fontsize=8, rotation=12)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)


def serving(ax, panel: str, results: list[tuple[str, dict]]) -> None:
    # engine -> concurrency -> run (later files win on a tie)
    points: dict[str, dict] = {}
    for _, r in results:
        for eng, runs in serving_runs(r).items():
            for run in runs:
                points.setdefault(eng, {})[run.get("max_concurrency")] = run
    concs = sorted({c for p in points.values() for c in p}, key=lambda c: float("inf") if c is None else c)
    x = {c: i for i, c in enumerate(concs)}
    for eng, runs in sorted(points.items(), key=lambda kv: ENGINE_ORDER.index(kv[0]) if kv[0] in ENGINE_ORDER else 99):
        cs = [c for c in concs if c in runs]
        color = COLORS.get(eng)
        if panel == "serving_tput":
            ax.plot([x[c] for c in cs], [runs[c]["output_token_throughput"] for c in cs], "o-", color=color, label=eng)
        else:
            key = "itl_ms" if panel == "serving_itl" else "ttft_ms"
            for pct, style in (("p50", "o-"), ("p90", "s--"), ("p99", "^:")):
                ys = [runs[c][key].get(pct) for c in cs]
                ax.plot([x[c] for c in cs], ys, style, color=color, label=f"{eng} {pct}")
    ax.set_xticks(range(len(concs)), [conc_label(c) for c in concs])
    ax.set_xlabel("max concurrency (requests in flight)")
    ax.set_ylabel({"serving_tput": "serving output tok/s", "serving_itl": "inter-token latency, ms",
                   "serving_ttft": "time to first token, ms"}[panel])
    if panel != "serving_tput":
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=3)


if __name__ == "__main__":
    main()
