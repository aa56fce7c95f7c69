"""Logit processors that depend on a request's history: logit_bias, penalties, min_new_tokens.

Each function edits the float32 `[B, V]` logits in place, touching only the entries of the
rows named in `idx` that it changes (sparse index ops, never a dense [B, V] pass), so a
penalty costs O(tokens the request has seen), not O(B * V).
Order (applied by the sampler): logit_bias -> repetition -> frequency/presence -> min_new mask.
"""
from __future__ import annotations

from itertools import chain

import torch

from radixlm.srt.model_runner.device_tensor import device_tensor, to_device
from radixlm.srt.model_runner.sampling_batch import SamplingRow

__all__ = ["apply_logit_bias", "apply_penalties", "mask_stop_tokens", "flat_keys"]


def _index(idx: list[int], device: torch.device) -> torch.Tensor:
    return device_tensor(idx, torch.int64, device)


def flat_keys(batch_rows: list[int], id_lists: list[list[int]], vocab_size: int,
              device: torch.device) -> torch.Tensor:
    """Positions `row * V + token` in the flattened [B, V] logits, one per listed token.

    Penalties touch only tokens a request has seen (hundreds) out of a vocabulary of tens
    of thousands, so they are applied by gathering and scattering these positions rather
    than with dense [B, V] masks. Ids outside [0, V) are dropped (never sampled anyway).
    """
    lens = [len(ids) for ids in id_lists]
    if sum(lens) == 0:
        return torch.empty(0, dtype=torch.int64, device=device)
    toks = torch.tensor(list(chain.from_iterable(id_lists)), dtype=torch.int64)
    rows = torch.repeat_interleave(torch.tensor(batch_rows, dtype=torch.int64), torch.tensor(lens))
    ok = (toks >= 0) & (toks < vocab_size)
    return to_device(rows[ok] * vocab_size + toks[ok], device)


def apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow], idx: list[int]) -> None:
    """Add params.logit_bias[token] to the logits of rows `idx` (one index_put for all)."""
    r: list[int] = []
    c: list[int] = []
    v: list[float] = []
    vocab = logits.shape[1]
    for i in idx:
        for tok, bias in (rows[i].params.logit_bias or {}).items():
            if 0 <= tok < vocab:
                r.append(i)
                c.append(tok)
                v.append(bias)
    if not r:
        return
    dev = logits.device
    logits.index_put_((_index(r, dev), _index(c, dev)),
                      device_tensor(v, logits.dtype, dev), accumulate=True)


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow], idx: list[int]) -> None:
    """Repetition, then frequency and presence penalties, on rows `idx` (logits contiguous).

    Repetition (HF / vLLM semantics): for every distinct token seen in prompt or output, a
    positive logit is divided by the penalty and a negative one multiplied, so penalty > 1
    always makes the token less likely. Frequency / presence (OpenAI semantics) count the
    output only: logit -= freq * count + presence * (count > 0).
    """
    if not idx:
        return
    dev = logits.device
    b, vocab = logits.shape
    flat = logits.view(-1)

    rep_rows = [i for i in idx if rows[i].params.repetition_penalty != 1.0]
    if rep_rows:
        lists = [rows[i].prompt_ids for i in rep_rows] + [rows[i].output_ids for i in rep_rows]
        keys = torch.unique(flat_keys(rep_rows + rep_rows, lists, vocab, dev))
        rep = _per_row(b, rep_rows, [rows[i].params.repetition_penalty for i in rep_rows], 1.0, dev)
        r = rep[keys // vocab]
        v = flat[keys]
        flat[keys] = torch.where(v > 0, v / r, v * r)

    fp_rows = [i for i in idx
               if rows[i].params.frequency_penalty != 0.0 or rows[i].params.presence_penalty != 0.0]
    if fp_rows:
        keys = flat_keys(fp_rows, [rows[i].output_ids for i in fp_rows], vocab, dev)
        if keys.numel():
            keys, counts = torch.unique(keys, return_counts=True)
            row_of = keys // vocab
            freq = _per_row(b, fp_rows, [rows[i].params.frequency_penalty for i in fp_rows], 0.0, dev)
            pres = _per_row(b, fp_rows, [rows[i].params.presence_penalty for i in fp_rows], 0.0, dev)
            flat[keys] -= freq[row_of] * counts.to(torch.float32) + pres[row_of]


def _per_row(b: int, idx: list[int], vals: list[float], default: float, dev: torch.device) -> torch.Tensor:
    """[B] float32 holding vals at rows idx and default elsewhere."""
    full = [default] * b
    for i, v in zip(idx, vals):
        full[i] = v
    return device_tensor(full, torch.float32, dev)


def mask_stop_tokens(logits: torch.Tensor, rows: list[SamplingRow], idx: list[int]) -> None:
    """Set the stop ids of rows `idx` to -inf (rows whose min_new_tokens is not reached)."""
    r: list[int] = []
    c: list[int] = []
    vocab = logits.shape[1]
    for i in idx:
        for tok in rows[i].stop_ids:
            if 0 <= tok < vocab:
                r.append(i)
                c.append(tok)
    if not r:
        return
    dev = logits.device
    logits.index_put_((_index(r, dev), _index(c, dev)),
                      torch.full((), float("-inf"), dtype=logits.dtype, device=dev))
