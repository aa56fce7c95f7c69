"""Command line (also the `radixlm` console script):

    python -m radixlm generate "prompt"     # one completion, offline
    python -m radixlm serve --port 30000    # the OpenAI-compatible and native HTTP server
"""
from __future__ import annotations

import argparse
import json
import sys

from radixlm.config import ServerArgs


def _checked_args(ns: argparse.Namespace) -> ServerArgs | None:
    """The arguments and the model they name, checked before anything starts; None after a
    one-line error on stderr (the caller exits with 2)."""
    from radixlm.srt.weights.loader import check_model

    try:
        args = ServerArgs.from_cli_args(ns)
        check_model(args.model_path)
    except (ValueError, FileNotFoundError) as e:
        print(f"radixlm: error: {e}", file=sys.stderr)
        return None
    return args


def _generate(ns: argparse.Namespace) -> int:
    from radixlm.srt.engine import Engine

    args = _checked_args(ns)
    if args is None:
        return 2
    with Engine(**{k: v for k, v in vars(args).items()}) as engine:
        prompt = ns.prompt
        if not ns.raw and getattr(engine.tokenizer, "chat_template", None):
            prompt = engine.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
        params = {"max_new_tokens": ns.max_new_tokens, "temperature": ns.temperature}
        if ns.stream:
            for chunk in engine.generate(prompt, params, stream=True):
                print(chunk["text"], end="", flush=True)
            print()
        else:
            out = engine.generate(prompt, params)
            print(json.dumps(out, indent=2) if ns.json else out["text"])
    return 0


def _serve(ns: argparse.Namespace) -> int:
    args = _checked_args(ns)
    if args is None:
        return 2
    if ns.dp_size > 1:
        from radixlm.srt.fleet.launch import FleetOptions, launch_dp

        if ns.speculative_algorithm is not None:
            raise SystemExit("radixlm: --speculative-algorithm with --dp-size > 1 is refused: speculation has not "
                             "been tested behind the fleet's gateway (each replica would draft on its own index)")

        options = FleetOptions(ns.dp_size, ns.dp_router, ns.dp_policy)
        return launch_dp(args, options, served_model_name=ns.served_model_name)
    from radixlm.srt.http_server import launch_server

    launch_server(args, served_model_name=ns.served_model_name)
    return 0


def _exit_now(code: int) -> None:
    """End a server process whose children are stopped and files removed, without the
    interpreter's finalization (seconds of garbage collection over torch's module state)."""
    import logging
    import os

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="radixlm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate a completion for one prompt")
    gen.add_argument("prompt")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    gen.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    gen.add_argument("--json", action="store_true", help="print the whole result with meta_info")
    ServerArgs.add_cli_args(gen)
    srv = sub.add_parser("serve", help="serve the OpenAI-compatible and native HTTP API")
    srv.add_argument("--served-model-name", default=None,
                     help="the model name clients use (default: the model path's basename)")
    srv.add_argument("--dp-size", type=int, default=1,
                     help="engine replicas on this machine (one process each, the CPU cores split between "
                          "them) behind a router on --host/--port")
    srv.add_argument("--dp-router", choices=("auto", "smg", "builtin"), default="auto",
                     help="the router in front of the replicas: the SGLang Model Gateway (smg) when it is "
                          "installed (auto), or radixlm's built-in dispatcher")
    srv.add_argument("--dp-policy", default="cache_aware",
                     help="routing policy (smg's --policy; the built-in dispatcher takes cache_aware = "
                          "prefix_hash, or round_robin)")
    ServerArgs.add_cli_args(srv)
    ns = parser.parse_args(argv)
    if ns.command == "generate":
        return _generate(ns)
    if ns.command == "serve":
        code = _serve(ns)
        if argv is None:  # the command line, not a caller in this interpreter
            _exit_now(code)
        return code
    return 2


if __name__ == "__main__":
    sys.exit(main())
