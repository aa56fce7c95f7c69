"""Host values onto the device without making the host wait for the device.

`torch.tensor(values, device="cuda")` and a plain `.to("cuda")` copy through pageable
memory and then synchronize the stream: the host waits for every kernel queued before it.
On the forward stream that would hold an overlapped launch of batch N+1 until batch N has
finished computing (semantics §7). These helpers pin the host tensor and copy it
asynchronously instead (the caching host allocator keeps the pinned block until the copy is
done); on the CPU they are plain tensors.
"""
from __future__ import annotations

from typing import Sequence

import torch


def to_device(t: torch.Tensor, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host tensor on `device` (converted to `dtype`), copied asynchronously on CUDA."""
    dev = torch.device(device)
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    if dev.type != "cuda" or t.device.type != "cpu":
        return t.to(dev)
    return t.pin_memory().to(dev, non_blocking=True)


def device_tensor(values: Sequence, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """torch.tensor(values, dtype=dtype, device=device), asynchronously on CUDA."""
    return to_device(torch.tensor(values, dtype=dtype), device)
