"""Command line (also the `radixlm` console script):

    python -m radixlm serve --port 30000                  # the OpenAI-compatible and native HTTP server
    python -m radixlm generate "prompt"                   # one completion, in-process
    python -m radixlm run-batch -i in.jsonl -o out.jsonl  # an OpenAI batch file, in-process

The commands live in radixlm/srt/cli/ (docs/cli.md).
"""
from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from radixlm.srt.cli.main import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
