"""A request's KV as chunks: (buffer, token range) -> bytes, and bytes -> slots.

The buffers are every tensor indexed by KV slot (`KVPool.slot_buffers()`: per layer K and V,
and an int8 pool's scales; the fake runner's token record in tests), in the same order on
both servers, so a chunk names its buffer by position. Both sides check the layout (row
bytes per buffer) before a transfer: servers with different models or KV dtypes refuse it.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["KVBuffers", "layout", "read_chunk", "write_chunk"]

KVBuffers = Callable[[], list[torch.Tensor]]


def row_bytes(buf: torch.Tensor) -> int:
    return int(buf[0].numel()) * buf.element_size()


def layout(buffers: list[torch.Tensor]) -> list[int]:
    """Bytes per slot of each buffer: what both sides must agree on."""
    return [row_bytes(b) for b in buffers]


def read_chunk(buf: torch.Tensor, slots: torch.Tensor) -> bytes:
    # index_select / index_copy_: ~4x faster than advanced indexing on the CPU
    rows = buf.index_select(0, slots.to(buf.device))
    return rows.view(-1).view(torch.uint8).cpu().numpy().tobytes()


def write_chunk(buf: torch.Tensor, slots: torch.Tensor, payload: bytes) -> None:
    """Writes the rows of `payload` into `slots` of `buf`; raises ValueError on a size mismatch."""
    n = int(slots.numel())
    if len(payload) != n * row_bytes(buf):
        raise ValueError(f"a chunk of {len(payload)} bytes for {n} slots of {row_bytes(buf)} bytes")
    rows = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(buf.dtype).view(n, *buf.shape[1:])
    buf.index_copy_(0, slots.to(buf.device), rows.to(buf.device))
