"""The vocabulary split over ranks: embedding lookups and LM-head logits of a vocabulary shard.

Rank r holds rows [start, stop) of the embedding (and of the LM head; with tied embeddings
they are the same rows). A lookup zeroes the ids outside the shard and the all-reduce adds
the one non-zero row per token, so it equals the unsplit lookup bit for bit. Logits are
computed for the shard and gathered into the full [n, vocab] on every rank, so every rank
samples from the same logits.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from radixlm.srt.distributed.comm import TPComm
from radixlm.srt.distributed.layout import Span


def embed(ids: torch.Tensor, weight: torch.Tensor, shard: Span, comm: TPComm) -> torch.Tensor:
    """[T] token ids -> [T, hidden] through this rank's rows [shard.start, shard.stop)."""
    if comm.size == 1:
        return F.embedding(ids, weight)
    outside = (ids < shard.start) | (ids >= shard.stop)
    local = (ids - shard.start).masked_fill_(outside, 0)
    out = F.embedding(local, weight)
    out.masked_fill_(outside.unsqueeze(-1), 0.0)
    return comm.all_reduce(out)


def gather_logits(local: torch.Tensor, spans: tuple[Span, ...], comm: TPComm) -> torch.Tensor:
    """[n, shard] logits of this rank's vocabulary range -> [n, vocab], the same on every rank."""
    if comm.size == 1:
        return local
    width = max(s.size for s in spans)
    if local.shape[-1] < width:  # uneven shards: pad to one shape for the gather
        local = F.pad(local, (0, width - local.shape[-1]))
    parts = comm.all_gather(local)
    return torch.cat([p[..., :s.size] for p, s in zip(parts, spans)], dim=-1)
