"""radixlm: an LLM serving engine for CPUs (and GPUs).

    radixlm serve --port 30000                    the OpenAI-compatible and native HTTP server
    radixlm generate "Write a haiku"              one completion, in-process
    radixlm run-batch -i in.jsonl -o out.jsonl    an OpenAI batch file, in-process

Each command's --help lists its options; docs/cli.md describes them.
"""
from __future__ import annotations

import argparse
import logging
import sys
import traceback

from radixlm.config import ServerArgs
from radixlm.srt.cli.preflight import UserError, check_model_path, check_port_free

# Exit codes: a user's mistake (as argparse's own errors), and a start-up that failed otherwise.
EXIT_USAGE = 2
EXIT_FAILED = 1


def _server_args(ns: argparse.Namespace) -> ServerArgs:
    try:
        return ServerArgs.from_cli_args(ns)
    except ValueError as e:
        raise UserError(str(e)) from None


def _serve(ns: argparse.Namespace) -> int:
    args = _server_args(ns)
    check_port_free(args.host, args.port)  # before the model loads (seconds), not after
    check_model_path(args.model_path)
    if ns.dp_size > 1:
        from radixlm.srt.fleet.launch import FleetOptions, launch_dp

        from radixlm.feature_rules import check_fleet_features

        try:
            check_fleet_features(ns.dp_size, ns.speculative_algorithm)
        except ValueError as e:
            raise UserError(str(e)) from None
        options = FleetOptions(ns.dp_size, ns.dp_router, ns.dp_policy)
        try:
            options.resolved_policy(options.resolved_router())
        except ValueError as e:
            raise UserError(str(e)) from None
        return launch_dp(args, options, served_model_name=ns.served_model_name)
    from radixlm.srt.http_server import launch_server

    launch_server(args, served_model_name=ns.served_model_name)
    return 0


def _generate(ns: argparse.Namespace) -> int:
    from radixlm.srt.cli import generate

    _server_args(ns)
    check_model_path(ns.model_path)
    return generate.run(ns)


def _run_batch(ns: argparse.Namespace) -> int:
    from radixlm.srt.cli import run_batch

    _server_args(ns)
    run_batch.check_files(ns)
    check_model_path(ns.model_path)
    return run_batch.run(ns)


def _add_serve(sub) -> None:
    from radixlm.srt.cli.options import HelpFormatter

    srv = sub.add_parser("serve", help="serve the OpenAI-compatible and native HTTP API",
                         formatter_class=HelpFormatter)
    srv.add_argument("--served-model-name", default=None,
                     help="the model name clients use (default: the model's name: the GGUF file name without "
                          "its quantisation suffix, or the checkpoint directory's name); the file name stays "
                          "accepted as an alias")
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


def build_parser() -> argparse.ArgumentParser:
    from radixlm.srt.cli import generate, run_batch

    parser = argparse.ArgumentParser(prog="radixlm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="{serve,generate,run-batch}")
    _add_serve(sub)
    generate.add_parser(sub)
    run_batch.add_parser(sub)
    return parser


COMMANDS = {"serve": _serve, "generate": _generate, "run-batch": _run_batch}


def _report(message: str, debug: bool) -> None:
    if debug:
        traceback.print_exc()
    print(f"radixlm: error: {message}", file=sys.stderr, flush=True)


def run_command(ns: argparse.Namespace) -> int:
    """The command's exit code; a user's mistake is one line on stderr and code 2, with the
    traceback only under --log-level debug."""
    debug = getattr(ns, "log_level", "warning") == "debug"
    try:
        return COMMANDS[ns.command](ns)
    except UserError as e:
        _report(str(e), debug)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    except RuntimeError as e:
        # a runtime process that failed to start: its own error is the first line
        if not str(e).startswith("the ") or "process" not in str(e).split(":", 1)[0]:
            raise
        first = str(e).splitlines()[0]
        _report(first if debug else first + " (--log-level debug shows the traceback)", debug)
        return EXIT_FAILED


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    if ns.command == "serve":
        code = run_command(ns)
        if argv is None:  # the command line, not a caller in this interpreter
            _exit_now(code)
        return code
    return run_command(ns)


def _exit_now(code: int) -> None:
    """End a server process whose children are stopped and files removed, without the
    interpreter's finalization (seconds of garbage collection over torch's module state)."""
    import os

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
