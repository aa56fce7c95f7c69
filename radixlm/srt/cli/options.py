"""Engine options on the offline commands (`generate`, `run-batch`).

They take every ServerArgs option `radixlm serve` takes, but list only the few a user of them
reaches for; the rest stay accepted and `radixlm serve --help` describes them, so `--help`
is not sixty lines of HTTP and fleet knobs.
"""
from __future__ import annotations

import argparse

from radixlm.config import ServerArgs

# ServerArgs fields shown in the offline commands' --help (the others are accepted, unlisted)
SHOWN = ("model_path", "tokenizer_path", "dtype", "context_length", "max_running_requests", "max_total_tokens",
         "log_level")
# ServerArgs fields that make no sense without the HTTP server: not accepted offline
SERVER_ONLY = ("host", "port", "api_key", "admin_api_key", "allowed_hosts", "max_payload_size",
               "http_header_timeout", "http_body_timeout")
MORE_OPTIONS = ("Every engine option of `radixlm serve` is accepted here too (--attention-backend, "
                "--chunked-prefill-size, --enable-hierarchical-cache, ...): see `radixlm serve --help`.")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, unless it has none (None, False) or its help says it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help_ = action.help or ""
        if action.default in (None, False) or "default" in help_:
            return help_
        return super()._get_help_string(action)


class RawHelpFormatter(HelpFormatter, argparse.RawDescriptionHelpFormatter):
    """HelpFormatter that keeps the description's line breaks."""


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine options")
    hidden = argparse.ArgumentParser(add_help=False)
    ServerArgs.add_cli_args(hidden)
    for action in hidden._actions:
        name = action.dest
        if name in SERVER_ONLY:
            continue
        if name not in SHOWN:
            action.help = argparse.SUPPRESS
        group._add_action(action)


def engine_kwargs(ns: argparse.Namespace) -> dict:
    """The ServerArgs keywords the namespace carries (checked by ServerArgs.from_kwargs)."""
    args = ServerArgs.from_cli_args(ns)
    return {k: v for k, v in vars(args).items()}
