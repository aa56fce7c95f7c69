"""The per-step grammar work of the forward: fill the token bitmask, apply it, accept tokens.

All of it runs on the forward side (the worker thread under the overlap scheduler), in batch
order, right around sampling: a matcher is advanced by the token sampled from its own mask
before any later batch builds the next mask, so no token can escape the grammar and the
overlap and normal loops produce identical outputs (semantics §7).

A matcher here is any object with `fill_bitmask(bitmask, row)`, `accept(token) -> bool` and
`terminated` (see xgrammar_backend.XGrammarMatcher).
"""
from __future__ import annotations

import logging
from typing import Any, Sequence

import torch

from radixlm.srt.model_runner.device_tensor import device_tensor
from radixlm.srt.model_runner.sampling_batch import VocabMask

logger = logging.getLogger(__name__)

_xgr_apply: Any = None  # xgrammar's apply kernel, resolved on first use (False: unavailable)
_BYTE_BITS: dict[torch.device, torch.Tensor] = {}


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def build_vocab_mask(matchers: Sequence[Any | None], vocab_size: int,
                     device: torch.device | str) -> VocabMask | None:
    """The mask of the sampled rows (one matcher or None per row), or None if none is constrained.

    A matcher already terminated (overlap: its request finished in the previous batch, whose
    result the scheduler has not processed yet) is left unmasked: that row's token is dropped.
    """
    rows = [j for j, m in enumerate(matchers) if m is not None and not m.terminated]
    if not rows:
        return None
    bitmask = torch.full((len(matchers), bitmask_width(vocab_size)), -1, dtype=torch.int32)
    for j in rows:
        matchers[j].fill_bitmask(bitmask, j)
    device = torch.device(device)
    if device.type != "cpu":
        bitmask = bitmask.to(device, non_blocking=True)
    return VocabMask(bitmask, rows)


def advance_matchers(matchers: Sequence[Any | None], tokens: Sequence[int | None]) -> list[str | None]:
    """Accept each sampled token into its row's matcher; the per-row grammar status
    ("terminated", "rejected", "error" or None) that BatchResult reports to the scheduler.
    A matcher that raises is that row's "error" (the scheduler ends that request alone):
    the other rows' matchers have advanced, so the batch must not fail as a whole."""
    status: list[str | None] = []
    for m, tok in zip(matchers, tokens):
        try:
            if m is None or tok is None or m.terminated:
                status.append(None)
            elif not m.accept(int(tok)):
                status.append("rejected")
            else:
                status.append("terminated" if m.terminated else None)
        except Exception:  # noqa: BLE001
            logger.exception("a grammar matcher failed to accept token %s", tok)
            status.append("error")
    return status


def apply_vocab_mask(logits: torch.Tensor, mask: VocabMask) -> None:
    """Set the logits of disallowed tokens to -inf in the masked rows (in place).

    xgrammar's kernels (C++ on CPU, CUDA/Triton on GPU) when it is installed; otherwise a
    byte lookup table in plain torch (same result, a few times slower on CPU).
    """
    global _xgr_apply
    if _xgr_apply is None:
        try:
            from xgrammar import apply_token_bitmask_inplace
            _xgr_apply = apply_token_bitmask_inplace
        except ImportError:
            _xgr_apply = False
    vocab = logits.shape[1]
    if _xgr_apply and logits.dtype == torch.float32 and logits.is_contiguous():
        rows = None if len(mask.rows) == logits.shape[0] else mask.rows
        _xgr_apply(logits, mask.bitmask, vocab_size=vocab, indices=rows)
        return
    _apply_torch(logits, mask, vocab)


def _apply_torch(logits: torch.Tensor, mask: VocabMask, vocab: int) -> None:
    dev = logits.device
    table = _BYTE_BITS.get(dev)
    if table is None:
        # bit k of byte b, for every byte value: little-endian int32 words make byte
        # 4w + i hold tokens 32w + 8i .. 32w + 8i + 7, so bytes map to tokens in order
        table = ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).bool().to(dev)
        _BYTE_BITS[dev] = table
    idx = device_tensor(mask.rows, torch.int64, dev)
    words = mask.bitmask.index_select(0, idx.to(mask.bitmask.device)).to(dev).contiguous()
    allowed = table[words.view(torch.uint8).long()].view(len(mask.rows), -1)[:, :vocab]
    sub = logits.index_select(0, idx).masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, idx, sub)
