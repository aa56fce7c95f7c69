"""Which feature combinations radixlm refuses, and why: the one place.

Each check raises ValueError with the reason; the callers only choose when it runs:
- `check_server_features(args)`: ServerArgs.verify, before anything is loaded (duck-typed on
  ServerArgs: this module sits below config in the layering);
- `check_fleet_features(dp_size, speculative_algorithm)`: `radixlm serve --dp-size`;
- `check_runtime_features(...)`: the scheduler process, once the runner chose its attention
  backend and the scheduler its loop;
- `check_scheduler_features(...)`: the scheduler's constructor (a SchedulerConfig made by hand);
- `check_transfer(mode, backend)`: the disaggregation builder.
"""
from __future__ import annotations

import json
import os
from typing import Any

__all__ = ["DISAGGREGATION_MODES", "TRANSFER_BACKENDS", "WHY_CPU_ONLY", "WHY_NO_OVERLAP", "check_server_features",
           "check_fleet_features", "check_runtime_features", "check_scheduler_features", "check_transfer"]

DISAGGREGATION_MODES = ("null", "prefill", "decode")
TRANSFER_BACKENDS = ("tcp",)  # RDMA engines (mooncake, nixl) would be added here: docs/disaggregation.md

WHY_CPU_ONLY = ("only the cpu attention backend is known to give a draft row's verify extend exactly the "
                "logits of sequential decode steps (test_verify_forward.py); torch_native differs by ~1e-5 "
                "and triton/flashinfer have not been run on this shape, so greedy output could change")
WHY_NO_OVERLAP = ("the next batch's inputs depend on how many drafts this step accepts, so it cannot be "
                  "built while this step runs; run with overlap off (no --enable-overlap-schedule; "
                  "--disable-overlap-schedule where it is on by default) as SGLang's ngram does")


def check_server_features(args: Any) -> None:
    """What ServerArgs.verify can tell before anything is loaded."""
    if args.disaggregation_mode != "null" and args.tp_size > 1:
        raise ValueError("disaggregation_mode prefill/decode runs with tp_size 1 for now")
    if args.speculative_algorithm is not None:
        _check_speculative_args(args)
    if args.hicache_storage_backend is not None:
        _check_storage_args(args)


def _check_storage_args(args: Any) -> None:
    if not args.enable_hierarchical_cache:
        raise ValueError("hicache_storage_backend is a tier under the host tier: it needs enable_hierarchical_cache")
    if args.hicache_storage_backend == "file" and not args.hicache_storage_dir:
        raise ValueError("hicache_storage_backend file needs hicache_storage_dir (a directory)")
    if args.hicache_storage_backend == "mooncake":
        try:
            extra = json.loads(args.hicache_storage_backend_extra_config or "{}")
        except json.JSONDecodeError as e:
            raise ValueError(f"hicache_storage_backend_extra_config is not JSON: {e}") from None
        if not isinstance(extra, dict):
            raise ValueError("hicache_storage_backend_extra_config must be a JSON object")
        if not extra.get("master_server_address") and not os.environ.get("MOONCAKE_MASTER"):
            raise ValueError("hicache_storage_backend mooncake needs the master's host:port: master_server_address "
                             "in hicache_storage_backend_extra_config, or MOONCAKE_MASTER")
    if args.tp_size > 1:
        raise ValueError("hicache_storage_backend runs with tp_size 1 for now: each rank holds a shard of every "
                         "page, and the ranks do not yet agree on a storage hit's length")
    if args.hicache_storage_prefetch_threshold < 0 or args.hicache_storage_prefetch_timeout <= 0:
        raise ValueError("hicache_storage_prefetch_threshold must be >= 0 and hicache_storage_prefetch_timeout > 0")


def _check_speculative_args(args: Any) -> None:
    if args.speculative_algorithm != "ngram":
        raise ValueError(f"speculative_algorithm must be ngram or unset, got {args.speculative_algorithm!r}")
    args.ngram_config()  # NgramConfig checks the numbers, naming the flag
    if args.tp_size > 1:
        raise ValueError("speculative decoding does not run with tp_size > 1 yet: every rank's drafter would "
                         "have to be fed the same tokens, which nothing checks")
    if args.disaggregation_mode != "null":
        raise ValueError("speculative decoding does not run with disaggregation_mode prefill/decode yet: a "
                         "prefill server decodes nothing, and a decode server's rows arriving with their KV "
                         "have not been run with drafts")
    if args.enable_overlap_schedule and not args.disable_overlap_schedule:
        raise ValueError(f"speculative decoding refuses overlap scheduling: {WHY_NO_OVERLAP}")
    if args.attention_backend not in ("auto", "cpu"):
        raise ValueError(f"speculative decoding needs attention_backend cpu, got {args.attention_backend!r}: "
                         f"{WHY_CPU_ONLY}")
    if args.device == "cuda":
        raise ValueError(f"speculative decoding runs on the CPU only: {WHY_CPU_ONLY}")


def check_fleet_features(dp_size: int, speculative_algorithm: str | None) -> None:
    if dp_size > 1 and speculative_algorithm is not None:
        raise ValueError("--speculative-algorithm with --dp-size > 1 is refused: speculation has not been "
                         "tested behind the fleet's gateway (each replica would draft on its own index)")


def check_runtime_features(*, speculative: bool, attention_backend: str, overlap: bool) -> None:
    """What is known once the runner chose its backend and the scheduler its loop."""
    if not speculative:
        return
    if attention_backend != "cpu":
        raise ValueError(f"speculative decoding needs the cpu attention backend, this runner uses "
                         f"{attention_backend!r} (did the native CPU kernels build?): {WHY_CPU_ONLY}")
    check_scheduler_features(speculative=speculative, overlap=overlap)


def check_scheduler_features(*, speculative: bool, overlap: bool) -> None:
    if speculative and overlap:
        raise ValueError(f"speculative decoding refuses overlap scheduling: {WHY_NO_OVERLAP}")


def check_transfer(mode: str, backend: str) -> None:
    if mode not in DISAGGREGATION_MODES:
        raise ValueError(f"disaggregation mode must be one of {DISAGGREGATION_MODES}, got {mode!r}")
    if mode != "null" and backend not in TRANSFER_BACKENDS:
        raise ValueError(f"unknown disaggregation transfer backend {backend!r}; have {TRANSFER_BACKENDS}")
