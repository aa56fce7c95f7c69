"""The `radixlm` command line: `serve`, `generate` and `run-batch` (docs/cli.md)."""
