"""Large CPU buffers backed by transparent huge pages (2 MiB).

The decode step streams each layer's slice of the KV pool and the packed int8 weights
from DRAM; with 4 KiB pages that is a TLB miss every 4 KiB. Where THP is in "madvise" mode
(the usual distribution default, and this machine's) memory is only backed by huge pages
after madvise(MADV_HUGEPAGE), and only pages first touched after the advice. torch.empty
cannot promise that: in a long-running process glibc serves even a 100 MiB request from
heap memory that earlier frees left behind, already backed by small pages. So these
buffers get their own private anonymous mapping, advised before anything touches it,
2 MiB-aligned, and wrapped as a tensor (the tensor keeps the mapping alive; it is unmapped
with the last reference).

RADIXLM_HUGEPAGES=0 turns it off; off Linux or below 4 MiB it is plain torch.empty.
"""
from __future__ import annotations

import ctypes
import math
import mmap
import sys

import torch

import radixlm.envs as envs

HUGE_PAGE = 2 << 20
_MIN_BYTES = 2 * HUGE_PAGE


def hugepages_enabled() -> bool:
    return envs.hugepages_enabled() and sys.platform.startswith("linux") and hasattr(mmap, "MADV_HUGEPAGE")


def empty_hugepage(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor, on huge pages where the kernel allows."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes < _MIN_BYTES or not hugepages_enabled():
        return torch.empty(shape, dtype=dtype)
    try:
        mm = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        mm.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, ValueError):
        return torch.empty(shape, dtype=dtype)
    base = ctypes.addressof(ctypes.c_char.from_buffer(mm))  # the temporary export ends here
    offset = (-base) % HUGE_PAGE
    raw = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=offset)
    return raw.view(dtype).view(shape)
