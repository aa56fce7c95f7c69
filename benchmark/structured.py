"""Structured-output costs; prints one JSON object.

    python benchmark/structured.py [--model-path PATH] [--num-requests 8] [--output-len 64]
                                   [--batch-sizes 1,8,32] [--skip-engine]

Measures:
- compile time of the benchmark grammars (first compile, and a cache hit through the queue's key);
- per-token mask overhead, in process on the model's vocabulary, per batch size: filling the
  rows' bitmasks, the sampler step with the mask vs without, and accepting the sampled tokens;
  their sum over the rows is the cost per constrained token (medians, on --mask-threads
  torch threads);
- end to end through the Engine: output throughput of unconstrained, JSON-schema and regex
  generation of the same prompts (greedy), and of a regex with a counted repetition, whose
  masks xgrammar cannot precompute (see REGEX_COUNTED).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "email": {"type": "string", "maxLength": 40},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                 "country": {"enum": ["FR", "DE", "US", "JP"]}},
                "required": ["city", "country"], "additionalProperties": False}},
    "required": ["name", "age", "email", "tags", "address"], "additionalProperties": False}
# Prose without a full stop: still open at --output-len tokens in practice, so the workloads
# produce about as many tokens as the unconstrained one and their throughputs compare directly.
REGEX = r"[A-Za-z ,]+"
# A counted repetition: xgrammar's precomputed token-mask cache does not cover the states
# inside it, so the mask of each step is computed on the fly (milliseconds per row).
REGEX_COUNTED = r"([A-Za-z]+ ){30,}[A-Za-z]+\."
QUESTIONS = ["Describe a customer of a bakery.", "Describe a software engineer in Berlin.",
             "Describe a student who likes music.", "Describe a retired teacher.",
             "Describe a chef in Tokyo.", "Describe a nurse who travels.",
             "Describe a farmer in Iowa.", "Describe a painter in Paris."]


def _timeit(fn, reps: int) -> float:
    """Median seconds of fn() over reps runs (after one warm-up)."""
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def bench_compile(backend) -> dict:
    from radixlm.sampling_params import SamplingParams
    out = {}
    for name, kind, spec in (("json_schema", "json_schema", SamplingParams.from_dict({"json_schema": SCHEMA}).json_schema),
                             ("regex", "regex", REGEX), ("regex_counted", "regex", REGEX_COUNTED)):
        t = time.perf_counter()
        backend.compile(kind, spec)
        out[f"{name}_ms"] = round((time.perf_counter() - t) * 1e3, 2)
    return out


def bench_fill_by_state(backend, vocab: int, reps: int) -> dict:
    """Bitmask fill per row (us) inside a word, for each regex: where the mask cache helps
    and where it does not."""
    from radixlm.srt.constrained.bitmask import build_vocab_mask
    out = {}
    for name, rx in (("regex", REGEX), ("regex_counted", REGEX_COUNTED)):
        m = backend.new_matcher(backend.compile("regex", rx))
        assert m.accept_string("Hello Wor")
        out[name] = round(_timeit(lambda: build_vocab_mask([m], vocab, "cpu"), reps) * 1e6, 1)
    return out


def bench_mask(backend, vocab: int, batch_sizes: list[int], reps: int) -> dict:
    """Per batch size, the parts of one constrained step, with every matcher held mid-string
    in a JSON document (a wide mask: the costly case for filling and applying it):
    fill each row's bitmask; the sampler step with the mask applied vs without; accepting the
    sampled token (timed with a rollback so the state stays put; xgrammar's rollback is cheap)."""
    import torch

    from radixlm.sampling_params import SamplingParams
    from radixlm.srt.constrained.bitmask import advance_matchers, build_vocab_mask
    from radixlm.srt.model_runner.sampler import Sampler, SamplingRow

    compiled = backend.compile("json_schema", json.dumps(SCHEMA))
    prefix = '{"name": "Ada Lovelace", "age": 36, "email": "ada@exa'
    sampler = Sampler(vocab)
    out: dict = {}
    for temp in (0.0, 0.8):
        for b in batch_sizes:
            logits = torch.randn(b, vocab)
            rows = [SamplingRow(SamplingParams.from_dict({"temperature": temp}), [1], []) for _ in range(b)]
            matchers = [backend.new_matcher(compiled) for _ in range(b)]
            for m in matchers:
                assert m.accept_string(prefix)
            mask = build_vocab_mask(matchers, vocab, "cpu")
            tokens = sampler.sample(logits, rows, vocab_mask=mask).next_token_ids

            def accept() -> None:
                assert not any(advance_matchers(matchers, tokens))
                for m in matchers:
                    m._m.rollback(1)

            t_fill = _timeit(lambda: build_vocab_mask(matchers, vocab, "cpu"), reps)
            t_plain = _timeit(lambda: sampler.sample(logits, rows), reps)
            t_masked = _timeit(lambda: sampler.sample(logits, rows, vocab_mask=mask), reps)
            t_accept = _timeit(accept, reps)
            per_token = (t_fill + t_masked - t_plain + t_accept) / b
            out[f"temp{temp}_batch{b}"] = {
                "sample_us": round(t_plain * 1e6, 1), "sample_masked_us": round(t_masked * 1e6, 1),
                "fill_bitmask_us": round(t_fill * 1e6, 1), "accept_and_rollback_us": round(t_accept * 1e6, 1),
                "overhead_us_per_token": round(per_token * 1e6, 2),
                "overhead_vs_sample_step": round((t_fill + t_masked - t_plain + t_accept) / t_plain, 3)}
    return out


def bench_engine(args) -> dict:
    from radixlm import Engine

    res: dict = {}
    with Engine(model_path=args.model_path, dtype=args.dtype) as engine:
        tok = engine.tokenizer
        prompts = []
        for i in range(args.num_requests):
            q = QUESTIONS[i % len(QUESTIONS)] + (f" (#{i})" if i >= len(QUESTIONS) else "")
            ids = tok.apply_chat_template([{"role": "user", "content": q}], tokenize=True, add_generation_prompt=True)
            prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
        # warm-up, including the tokenizer analysis of the first structured request
        engine.generate(input_ids=prompts[0], sampling_params={"max_new_tokens": 2, "regex": "[a-z]+"})
        workloads = {"unconstrained": {"ignore_eos": True}, "json_schema": {"json_schema": SCHEMA},
                     "regex": {"regex": REGEX}, "regex_counted": {"regex": REGEX_COUNTED}}
        for name, extra in workloads.items():
            params = {"max_new_tokens": args.output_len, "temperature": 0, **extra}
            wall = float("inf")
            for _ in range(args.repeat):  # best of: the machine may be shared
                engine.flush_cache()
                t = time.perf_counter()
                outs = engine.generate(input_ids=prompts, sampling_params=params)
                wall = min(wall, time.perf_counter() - t)
            tokens = sum(len(o["output_ids"]) for o in outs)
            res[name] = {"wall_s": round(wall, 3), "output_tokens": tokens,
                         "output_tok_per_s": round(tokens / wall, 1),
                         "finished_by_grammar": sum(o["meta_info"]["finish_reason"]["type"] == "stop" for o in outs)}
        base = res["unconstrained"]["output_tok_per_s"]
        for name in ("json_schema", "regex", "regex_counted"):
            res[name]["throughput_vs_unconstrained"] = round(res[name]["output_tok_per_s"] / base, 3)
        info = engine.get_server_info()
        res["grammar_cache"] = {k: info.get(k) for k in ("grammar_compiles", "grammar_cache_hits")}
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-requests", type=int, default=8)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--reps", type=int, default=30, help="timing repetitions of the in-process measurements")
    ap.add_argument("--repeat", type=int, default=2, help="runs of each Engine workload (best is reported)")
    ap.add_argument("--skip-engine", action="store_true", help="only the in-process measurements")
    ap.add_argument("--mask-threads", type=int, default=1,
                    help="torch threads for the in-process measurements (1: stable on a busy machine)")
    args = ap.parse_args()

    from radixlm.srt.constrained.xgrammar_backend import XGrammarBackend
    from radixlm.srt.weights.loader import load_model_config, resolve_model_path
    from radixlm.srt.weights.tokenizer import load_tokenizer

    path = resolve_model_path(args.model_path)
    vocab = load_model_config(path).vocab_size
    tokenizer = load_tokenizer(path)
    backend = XGrammarBackend(tokenizer, vocab, [tokenizer.eos_token_id])
    result: dict = {"workload": vars(args), "vocab_size": vocab}
    t = time.perf_counter()
    backend.compile("regex", "a")  # tokenizer analysis happens on the first compile
    result["tokenizer_info_ms"] = round((time.perf_counter() - t) * 1e3, 1)
    result["compile"] = bench_compile(backend)
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(args.mask_threads)
    result["fill_bitmask_us_mid_word"] = bench_fill_by_state(backend, vocab, args.reps)
    result["mask"] = bench_mask(backend, vocab, [int(b) for b in args.batch_sizes.split(",")], args.reps)
    torch.set_num_threads(threads)
    if not args.skip_engine:
        result["engine"] = bench_engine(args)
    json.dump(result, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
