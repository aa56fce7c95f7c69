"""Reassembling a weight from the ranks' shards (get_weights_by_name under tensor parallelism)."""
from __future__ import annotations

import torch

from radixlm.srt.distributed.layout import Shard


def assemble(parts: list[tuple[Shard | None, torch.Tensor]]) -> torch.Tensor:
    """Every rank's (shard, part) of the first rows of one tensor -> those rows of the whole
    tensor. A replicated tensor is rank 0's part; replicated KV heads overwrite each other
    with equal values."""
    whole = [t for s, t in parts if s is None]
    if whole:  # replicated (every rank holds it all), or a row-parallel bias (rank 0 alone)
        return whole[0]
    split = [(s, t) for s, t in parts if s is not None and s.held]
    dim, full = split[0][0].dim, split[0][0].full
    if dim == 0:
        rows = max((s.start + t.shape[0] for s, t in split if t.shape[0]), default=0)
        out = torch.empty((rows, *split[0][1].shape[1:]), dtype=split[0][1].dtype)
        for s, t in split:
            if t.shape[0]:
                out[s.start:s.start + t.shape[0]] = t
        return out
    out = torch.empty((split[0][1].shape[0], full), dtype=split[0][1].dtype)
    for s, t in split:
        out[:, s.start:s.stop] = t
    return out
