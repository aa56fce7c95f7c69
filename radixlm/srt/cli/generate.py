"""`radixlm generate "prompt"`: one completion from an in-process Engine.

Sampling options left unset take the model's generation_config.json values, then the
engine's defaults (temperature 1.0, top_p 1.0, top_k off), as `radixlm serve` and SGLang and
vLLM do: a GGUF file has no generation config, so its output is sampled, not greedy (greedy
decoding of a small model loops; ask for it with --temperature 0).
"""
from __future__ import annotations

import argparse
import json
import sys

from radixlm.srt.cli.options import MORE_OPTIONS, HelpFormatter, add_engine_options, engine_kwargs

FROM_MODEL = "the model's generation_config.json, else {}"


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("generate", help="generate a completion for one prompt (in-process, no server)",
                       description=__doc__, epilog=MORE_OPTIONS,
                       formatter_class=HelpFormatter)
    p.add_argument("prompt", help="the prompt (a user message when --chat)")
    s = p.add_argument_group("sampling")
    s.add_argument("--max-new-tokens", type=int, default=128, help="most tokens to generate")
    s.add_argument("--temperature", type=float, default=None,
                   help=f"sampling temperature, 0 = greedy (default: {FROM_MODEL.format('1.0')})")
    s.add_argument("--top-p", type=float, default=None,
                   help=f"nucleus sampling mass (default: {FROM_MODEL.format('1.0')})")
    s.add_argument("--top-k", type=int, default=None,
                   help=f"sample among the k likeliest tokens, -1 = all (default: {FROM_MODEL.format('-1')})")
    s.add_argument("--seed", type=int, default=None, help="sampling seed, for a repeatable output")
    s.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="stop at this text (not included in the output); repeatable")
    out = p.add_argument_group("input and output")
    out.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                     help="apply the model's chat template to the prompt (when it has one)")
    out.add_argument("--raw", dest="chat", action="store_false", help=argparse.SUPPRESS)  # older name of --no-chat
    out.add_argument("--stream", action="store_true", help="print the text as it is generated")
    out.add_argument("--json", action="store_true",
                     help="print the whole result (text, output_ids, meta_info) as JSON")
    add_engine_options(p)
    return p


def sampling_params(ns: argparse.Namespace) -> dict:
    """Only what the user set: the rest comes from the model's defaults in the engine."""
    params: dict = {"max_new_tokens": ns.max_new_tokens}
    for name in ("temperature", "top_p", "top_k", "seed"):
        if getattr(ns, name) is not None:
            params[name] = getattr(ns, name)
    if ns.stop:
        params["stop"] = list(ns.stop)
    return params


def run(ns: argparse.Namespace) -> int:
    from radixlm.srt.engine import Engine

    with Engine(**engine_kwargs(ns)) as engine:
        prompt = ns.prompt
        if ns.chat and getattr(engine.tokenizer, "chat_template", None):
            prompt = engine.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
        params = sampling_params(ns)
        if ns.stream:
            last = None
            for chunk in engine.generate(prompt, params, stream=True):
                last = chunk
                if not ns.json:
                    print(chunk["text"], end="", flush=True)
            if ns.json and last is not None:
                print(json.dumps(last["meta_info"], indent=2))
            else:
                print()
        else:
            out = engine.generate(prompt, params)
            print(json.dumps(out, indent=2) if ns.json else out["text"])
        sys.stdout.flush()
    return 0
