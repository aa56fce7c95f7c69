"""How often n-gram drafts would be accepted, with no model: the real continuation stands in for
the target's greedy output.

    python benchmark/micro/ngram_acceptance.py [--num-draft-tokens 4 8] [--max-files 6] [--measure-cost 1 32]

Each workload is a list of (prompt, continuation) texts built from this repository's own files,
tokenized with the default model's tokenizer (SmolLM2). For every request the drafter proposes
from prompt + continuation-so-far; the draft's longest prefix that equals the continuation is
accepted, and the step emits it plus one token (the target's correction or bonus), exactly as
verification would with a greedy target. Finished requests go into the cross-request index.

Workloads: code_edit (a file and the same file with one identifier renamed), quote_summary (a
document and a summary that quotes every third sentence), novel (a continuation that has
nothing to do with the prompt: the floor), resample (each novel request asked twice, as the n
samples of an RL rollout with a near-deterministic policy; only the second is measured: it can
find the first in the index).

Printed per workload and mode ("context": own context only; "context+index"; and
"context+index+adaptive": each request verifies the draft length that
radixlm/speculative/adaptive.py picks for --extra-token-cost): mean accepted length per step
(tokens emitted per verify step, the bonus included: SGLang's spec_accept_length), acceptance
rate (accepted / drafted tokens, also split by the length of the n-gram match the draft came
from: what an adaptive policy would cut on), the share of steps with a draft, the drafter's mean
time per proposal, and est_speedup: tokens per unit of step cost when a step verifying k drafts
costs 1 + extra_token_cost * k decode steps (an estimate under that cost model, not a
measurement); plus the index's measured bytes per entry (tracemalloc).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import time
import tracemalloc
from collections import Counter

import numpy as np

from radixlm.speculative.adaptive import AcceptanceTracker, AdaptiveConfig
from radixlm.speculative.drafter import NgramConfig, NgramDrafter

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CODE_FILES = ["radixlm/scheduler/policy.py", "radixlm/scheduler/retract.py", "radixlm/radix_cache/eviction.py",
              "radixlm/speculative/ngram_index.py", "radixlm/scheduler/batch.py", "radixlm/hicache/host_pool.py"]
DOC_FILES = ["docs/architecture.md", "radixlm/radix_cache/README.md", "radixlm/hicache/README.md",
             "radixlm/kernels/README.md", "docs/performance.md", "README.md"]
MAX_CHARS = 6000  # keeps every prompt within a couple of thousand tokens


def read(path: str) -> str:
    with open(os.path.join(ROOT, path)) as f:
        return f.read()[:MAX_CHARS]


def code_edit(paths: list[str]) -> list[tuple[str, str]]:
    out = []
    for p in paths:
        src = read(p)
        idents = re.findall(r"\b[a-z_][a-z0-9_]{4,}\b", src)
        words = Counter(w for w in idents if w not in ("return", "import", "class"))
        name = words.most_common(1)[0][0]
        edited = re.sub(rf"\b{name}\b", name + "_v2", src)
        out.append((f"Rename `{name}` to `{name}_v2` in this file and print the whole file.\n```python\n{src}```\n",
                    f"```python\n{edited}```\n"))
    return out


def sentences(text: str) -> list[str]:
    return [s.strip() for s in re.split(r"(?<=[.!?])\s+", text) if len(s.strip()) > 20]


def quote_summary(paths: list[str]) -> list[tuple[str, str]]:
    out = []
    for p in paths:
        doc = read(p)
        picked = sentences(doc)[::3]
        summary = " ".join(f"Point {i + 1}: the text says \"{s}\"" for i, s in enumerate(picked))
        out.append((f"Summarize this document, quoting its key sentences.\n\n{doc}\n", summary))
    return out


def novel(paths: list[str]) -> list[tuple[str, str]]:
    # Prompt: one document; continuation: the next one (unrelated text, no copy to find).
    docs = [read(p) for p in paths]
    return [(f"Write something new.\n\n{docs[i]}\n", docs[(i + 1) % len(docs)][:2000]) for i in range(len(docs))]


def simulate(reqs: list[tuple[list[int], list[int], bool]], cfg: NgramConfig, cost: float,
             adaptive: AdaptiveConfig | None = None) -> dict:
    """Run every request through the drafter in order; count only the ones marked measured
    (the unmeasured ones are the first samples of `resample`: they only fill the index).
    With `adaptive`, each request verifies only the draft length its AcceptanceTracker picks."""
    d = NgramDrafter(cfg)
    steps = drafted = accepted = drafted_steps = tokens = measured = 0
    step_cost = 0.0
    t_propose = 0.0
    by_len: dict[str, list[int]] = {}  # match length bucket -> [drafted, accepted]
    for prompt, target, measure in reqs:
        # One buffer per request, as the scheduler would keep it: proposing from a view of it
        # costs no copy of the context.
        buf = np.array(prompt + target, dtype=np.int64)
        pos = 0
        r_steps = r_drafted = r_accepted = r_drafted_steps = 0
        r_cost = 0.0
        tracker = AcceptanceTracker()
        while pos < len(target):
            left = len(target) - pos
            ctx = buf[:len(prompt) + pos]
            t0 = time.perf_counter()
            proposal = d.propose(ctx, max_tokens=left - 1)
            draft = proposal.tokens
            if adaptive is not None:
                draft = draft[:tracker.draft_length(proposal.match_length, len(draft), cost, adaptive)]
            t_propose += time.perf_counter() - t0 if measure else 0.0
            n = 0
            while n < len(draft) and draft[n] == target[pos + n]:
                n += 1
            if adaptive is not None:
                tracker.observe(len(draft), n, adaptive)
            r_steps += 1
            r_cost += 1.0 + cost * len(draft)
            r_drafted += len(draft)
            r_drafted_steps += bool(draft)
            r_accepted += n
            if measure and draft:
                b = by_len.setdefault(_bucket(proposal.match_length), [0, 0])
                b[0] += len(draft)
                b[1] += n
            pos += n + 1  # the accepted run plus the target's own token
        d.on_finish(prompt, target)
        if measure:
            measured += 1
            tokens += len(target)
            steps += r_steps
            step_cost += r_cost
            drafted += r_drafted
            drafted_steps += r_drafted_steps
            accepted += r_accepted
    return {"requests": measured, "tokens": tokens, "steps": steps,
            "mean_accept_length": round(tokens / steps, 3),
            # Plain decoding costs one step per token; a step verifying k drafts 1 + cost * k.
            "est_speedup": round(tokens / step_cost, 3),
            "acceptance_rate": round(accepted / drafted, 3) if drafted else 0.0,
            "draft_step_share": round(drafted_steps / steps, 3),
            "drafted_tokens": drafted, "accepted_tokens": accepted,
            "acceptance_rate_by_match_length": {b: round(a / dr, 3) for b, (dr, a) in sorted(by_len.items())},
            "propose_us_mean": round(1e6 * t_propose / steps, 1),
            "index_entries": len(d.index), "source_counts": {"context": d.stats.from_context,
                                                             "index": d.stats.from_index}}


def _bucket(length: int) -> str:
    return "1" if length == 1 else "2" if length == 2 else "3-4" if length <= 4 else "5+"


def index_bytes_per_entry(seqs: list[list[int]], cfg: NgramConfig) -> float:
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    d = NgramDrafter(cfg)
    for s in seqs:
        d.on_finish([], s)
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    return round(used / max(1, len(d.index)), 1)


def measure_extra_token_cost(batch: int, k: int, dtype: str, repeats: int = 5,
                             quantization: str | None = None) -> dict:
    """Forward + LM head wall time of a decode step (batch rows x 1 token) and of a verify step
    (batch rows x (k + 1) tokens, cpu backend) on the default model; their ratio gives the cost
    of one verified token relative to a decode step: (t_verify / t_decode - 1) / k."""
    import torch

    from radixlm.config import ServerArgs
    from radixlm.srt.model_runner.forward_batch import ForwardBatch, ForwardMode
    from radixlm.srt.model_runner.runner import ModelRunner

    args = ServerArgs(model_path=None, dtype=dtype, quantization=quantization, attention_backend="cpu",
                      max_total_tokens=16384)
    r = ModelRunner(args.runner_config() if hasattr(args, "runner_config") else args)
    table = r.req_to_token if hasattr(r, "req_to_token") else r.req_to_token_pool.req_to_token
    prompt_len = 256
    # Fixed slots: every request's prompt KV, then room for the step's tokens (values do not matter).
    for b in range(batch):
        table[b, :prompt_len + k + 1] = torch.arange(1 + b * (prompt_len + k + 1), 1 + (b + 1) * (prompt_len + k + 1))

    @torch.inference_mode()
    def step(n: int) -> float:
        mode = ForwardMode.DECODE if n == 1 else ForwardMode.EXTEND
        loc = torch.cat([table[b, prompt_len:prompt_len + n] for b in range(batch)])
        ids = [(101 * b + 7 * j) % 40000 + 100 for b in range(batch) for j in range(n)]
        fb = ForwardBatch.build(mode, ids, loc, list(range(batch)), [prompt_len] * batch, [n] * batch, table, "cpu")
        t0 = time.perf_counter()
        r.attn.init_forward_metadata(fb)
        r.model.compute_logits(r.model.forward(fb, r.attn))
        return time.perf_counter() - t0

    step(1), step(k + 1)  # warm-up
    t_dec = min(step(1) for _ in range(repeats))
    t_ver = min(step(k + 1) for _ in range(repeats))
    return {"batch": batch, "k": k, "dtype": dtype, "decode_ms": round(1e3 * t_dec, 2),
            "quantization": quantization,
            "verify_ms": round(1e3 * t_ver, 2), "extra_token_cost": round((t_ver / t_dec - 1) / k, 3)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-draft-tokens", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--min-window", type=int, default=1)
    ap.add_argument("--max-window", type=int, default=12)
    ap.add_argument("--max-files", type=int, default=6)
    ap.add_argument("--extra-token-cost", type=float, default=0.2,
                    help="cost of one more verified token relative to a decode step (for est_speedup and "
                         "the adaptive mode; --measure-cost measures it)")
    ap.add_argument("--measure-cost", type=int, nargs="*", metavar="BATCH",
                    help="also time decode vs verify forwards of the default model (cpu backend) at these batch "
                         "sizes, and use the first one's extra_token_cost")
    ap.add_argument("--dtype", default="bfloat16", help="model dtype for --measure-cost")
    ap.add_argument("--quantization", choices=["w8a8_int8"], help="weights' quantization for --measure-cost")
    args = ap.parse_args()
    from radixlm.srt.weights.loader import default_model_path
    from radixlm.srt.weights.tokenizer import load_tokenizer
    tok = load_tokenizer(default_model_path())
    costs = [measure_extra_token_cost(b, max(args.num_draft_tokens), args.dtype, quantization=args.quantization)
             for b in args.measure_cost or []]
    if costs:
        args.extra_token_cost = max(costs[0]["extra_token_cost"], 0.0)

    def enc(pairs: list[tuple[str, str]]) -> list[tuple[list[int], list[int], bool]]:
        return [(tok.encode(p), tok.encode(c, add_special_tokens=False), True) for p, c in pairs]

    code, docs = CODE_FILES[:args.max_files], DOC_FILES[:args.max_files]
    novel_reqs = enc(novel(docs))
    workloads = {"code_edit": enc(code_edit(code)), "quote_summary": enc(quote_summary(docs)),
                 "novel": novel_reqs,
                 # The first sample of each prompt only fills the index; the second is measured.
                 "resample": [(p, t, second) for p, t, _ in novel_reqs for second in (False, True)]}
    result: dict = {"benchmark": "ngram_acceptance", "tokenizer": "SmolLM2-135M-Instruct",
                    "target": "the real continuation (greedy target stand-in)",
                    "windows": [args.min_window, args.max_window], "extra_token_cost": args.extra_token_cost,
                    "measured_cost": costs, "workloads": {}}
    for name, reqs in workloads.items():
        per_k = {}
        for k in args.num_draft_tokens:
            modes = {}
            for mode, cap, adaptive in (("context", 0, None), ("context+index", 1 << 18, None),
                                        ("context+index+adaptive", 1 << 18, AdaptiveConfig())):
                cfg = NgramConfig(num_draft_tokens=k, min_match_window=args.min_window,
                                  max_match_window=args.max_window, capacity=cap)
                modes[mode] = simulate(reqs, cfg, args.extra_token_cost, adaptive)
            per_k[f"k={k}"] = modes
        result["workloads"][name] = per_k
    all_seqs = [t for reqs in workloads.values() for _, t, _ in reqs]
    result["index_bytes_per_entry"] = index_bytes_per_entry(
        all_seqs, NgramConfig(num_draft_tokens=max(args.num_draft_tokens), max_match_window=args.max_window))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
