"""Speculative decoding with n-gram drafts: drafting, verification, adaptive length.

The engine runs them through scheduler/speculation.py and srt/model_runner/verify.py
(docs/speculative.md).
"""
from radixlm.speculative.acceptance import RowSampler, Verified, verification_rows, verify_drafts
from radixlm.speculative.adaptive import AcceptanceTracker, AdaptiveConfig, best_draft_length
from radixlm.speculative.drafter import Draft, DrafterStats, NgramConfig, NgramDrafter
from radixlm.speculative.ngram_index import NgramIndex

__all__ = ["AcceptanceTracker", "AdaptiveConfig", "Draft", "DrafterStats", "NgramConfig", "NgramDrafter",
           "NgramIndex", "RowSampler", "Verified", "best_draft_length", "verification_rows", "verify_drafts"]
