"""The host KV pool: a second copy of the device KV layout in host RAM, plus its slot allocator.

It mirrors whatever buffers the device pool keeps (for the real model: one K and one V tensor
per layer, `[size + 1, kv_heads, head_dim]`, and with --kv-cache-dtype int8 those are int8 plus
one float32 `[size + 1, kv_heads]` scale tensor each; for the unit tests' fake model: one 1-D
tensor of token ids), each in its own dtype and shape, so a device→host or host→device copy is
the same indexed gather/scatter for every buffer and moves the bytes unchanged. Host slots are
numbered 1..capacity like device slots (row 0 unused), which lets the integrity checks share
the device pool's slot-ownership check.

Sizing (semantics §6): `hicache_size` GB when > 0, else `hicache_ratio × device capacity`.
Start-up refuses a pool that would leave less than `min_free_bytes` of RAM available, with a
message naming the knobs, instead of letting the OOM killer find out later.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from radixlm.radix_cache.memory_pool import TokenToKVPoolAllocator

logger = logging.getLogger(__name__)

__all__ = ["HostKVPool", "HostPoolSizing", "host_pool_size", "available_ram_bytes", "MIN_FREE_RAM_BYTES"]

# RAM that must stay available after the host pool is allocated (SGLang keeps 10 GiB; this
# project targets small machines, where 2 GiB still leaves room for the tokenizer, the
# detokenizer and the OS page cache).
MIN_FREE_RAM_BYTES = 2 << 30


def available_ram_bytes() -> int:
    """MemAvailable from /proc/meminfo (what the kernel could hand out without swapping)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import psutil
        return int(psutil.virtual_memory().available)
    except ImportError:  # pragma: no cover - neither source: do not block start-up on a guess
        return 1 << 62


def bytes_per_token(device_buffers: list[torch.Tensor]) -> int:
    """Bytes one token slot takes across all buffers (all layers' K and V, and their scales for
    an int8 pool: each buffer counts with its own shape and element size)."""
    return sum(b[0].numel() * b.element_size() for b in device_buffers)


@dataclass(frozen=True)
class HostPoolSizing:
    capacity: int  # host token slots
    bytes_per_token: int

    @property
    def total_bytes(self) -> int:
        return (self.capacity + 1) * self.bytes_per_token


def host_pool_size(device_capacity: int, device_buffers: list[torch.Tensor], ratio: float = 2.0,
                   size_gb: float = 0.0, page_size: int = 1) -> HostPoolSizing:
    """Host capacity in tokens, rounded down to whole pages (at least one page)."""
    per_token = bytes_per_token(device_buffers)
    if size_gb and size_gb > 0:
        tokens = int(size_gb * 1e9 // per_token)
    else:
        if ratio <= 0:
            raise ValueError(f"hicache_ratio must be > 0, got {ratio}")
        tokens = int(math.floor(device_capacity * ratio))
    tokens = max(tokens // page_size * page_size, page_size)
    return HostPoolSizing(tokens, per_token)


class HostKVPool:
    """Host buffers shaped like the device ones, and the free list of host slots."""

    def __init__(self, device_buffers: list[torch.Tensor], capacity: int, *, pin_memory: bool | None = None,
                 min_free_bytes: int = MIN_FREE_RAM_BYTES) -> None:
        if capacity < 1:
            raise ValueError("host KV pool capacity must be >= 1")
        if not device_buffers:
            raise ValueError("host KV pool needs at least one device buffer to mirror")
        self.capacity = capacity
        self.bytes_per_token = bytes_per_token(device_buffers)
        need = (capacity + 1) * self.bytes_per_token
        avail = available_ram_bytes()
        if need > avail - min_free_bytes:
            raise ValueError(
                f"HiCache host pool of {capacity} tokens needs {need / 1e9:.2f} GB of RAM, but only "
                f"{avail / 1e9:.2f} GB is available and {min_free_bytes / 1e9:.2f} GB must stay free; "
                "lower --hicache-ratio or set a smaller --hicache-size (GB)")
        device = device_buffers[0].device
        # Pinned pages make host<->GPU copies asynchronous; on a CPU-only run pinning is
        # impossible and pointless.
        pin = (device.type == "cuda") if pin_memory is None else pin_memory
        self.buffers: list[torch.Tensor] = [
            torch.empty((capacity + 1, *b.shape[1:]), dtype=b.dtype, pin_memory=pin) for b in device_buffers]
        # debug=True: a double free of a host slot raises like one of a device slot.
        self.allocator = TokenToKVPoolAllocator(capacity, device="cpu", debug=True)
        logger.info("HiCache host pool: %d tokens, %.3f GB%s", capacity, need / 1e9,
                    " (pinned)" if pin else "")

    # ---- slots ----
    def alloc(self, n: int) -> torch.Tensor | None:
        return self.allocator.alloc(n)

    def free(self, indices: torch.Tensor) -> None:
        self.allocator.free(indices)

    def available_size(self) -> int:
        return self.allocator.available_size()

    def used_size(self) -> int:
        return self.capacity - self.allocator.available_size()

    def clear(self) -> None:
        self.allocator.clear()

    def free_slots(self) -> set[int]:
        return self.allocator.free_slots()

    def total_bytes(self) -> int:
        return (self.capacity + 1) * self.bytes_per_token
