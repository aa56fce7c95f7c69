"""Which configurations speculative decoding refuses, and why (docs/speculative.md).

Duck-typed on ServerArgs (this package sits below config in the layering).
"""
from __future__ import annotations

from typing import Any

__all__ = ["check_speculative_args", "check_speculative_runtime"]

WHY_CPU_ONLY = ("only the cpu attention backend is known to give a draft row's verify extend exactly the "
                "logits of sequential decode steps (test_verify_forward.py); torch_native differs by ~1e-5 "
                "and triton/flashinfer have not been run on this shape, so greedy output could change")
WHY_NO_OVERLAP = ("the next batch's inputs depend on how many drafts this step accepts, so it cannot be "
                  "built while this step runs; run with overlap off (no --enable-overlap-schedule; "
                  "--disable-overlap-schedule where it is on by default) as SGLang's ngram does")


def check_speculative_args(args: Any) -> None:
    """What ServerArgs.verify can tell before anything is loaded."""
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


def check_speculative_runtime(attention_backend: str, overlap: bool) -> None:
    """What is known once the runner chose its backend and the scheduler its loop."""
    if attention_backend != "cpu":
        raise ValueError(f"speculative decoding needs the cpu attention backend, this runner uses "
                         f"{attention_backend!r} (did the native CPU kernels build?): {WHY_CPU_ONLY}")
    if overlap:
        raise ValueError(f"speculative decoding refuses overlap scheduling: {WHY_NO_OVERLAP}")
