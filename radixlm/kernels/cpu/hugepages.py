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

Buffers below 4 MiB (each layer's packed weights and their corrections: the default model's
are 0.3-3.5 MiB) are carved one after another out of shared 32 MiB mappings instead, so that
they are on huge pages too: with a mapping of their own each would hold a whole 2 MiB page
for a few hundred KiB. A decode step's 120 int8 GEMMs over weights streamed from DRAM
(benchmark/micro/weight_pages.py): 1.04-1.07x faster at batch 32 and 1.12-1.14x at batch 1
on the shared huge pages. A mapping is unmapped once every tensor carved from it is gone and
it is no longer the one being filled, so repacking after weight updates leaves at most one
partly used mapping behind per generation.

RADIXLM_HUGEPAGES=0 turns it off (plain torch.empty); off Linux it is plain torch.empty.
"""
from __future__ import annotations

import ctypes
import math
import mmap
import sys
import threading

import torch

import radixlm.envs as envs

HUGE_PAGE = 2 << 20
_MIN_BYTES = 2 * HUGE_PAGE  # from here on a buffer gets a mapping of its own
_ARENA_BYTES = 16 * HUGE_PAGE  # one shared mapping for the smaller buffers
_ALIGN = 64  # a cache line: no buffer shares a line with the next


def hugepages_enabled() -> bool:
    return envs.hugepages_enabled() and sys.platform.startswith("linux") and hasattr(mmap, "MADV_HUGEPAGE")


def _huge_mapping(nbytes: int) -> tuple[mmap.mmap, int] | None:
    """A fresh anonymous mapping advised for huge pages with room for nbytes from a 2 MiB
    boundary, and the offset of that boundary; None where the kernel refuses."""
    try:
        mm = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        mm.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, ValueError):
        return None
    base = ctypes.addressof(ctypes.c_char.from_buffer(mm))  # the temporary export ends here
    return mm, (-base) % HUGE_PAGE


class _Arena:
    """Hands out consecutive pieces of one huge-page mapping at a time. Each tensor holds its
    mapping alive (torch.frombuffer keeps a reference); the arena holds only the one it fills."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._mm: mmap.mmap | None = None
        self._next = 0
        self._end = 0

    def take(self, nbytes: int) -> torch.Tensor | None:
        with self._lock:
            if self._mm is None or self._next + nbytes > self._end:
                got = _huge_mapping(_ARENA_BYTES)
                if got is None:
                    return None
                self._mm, self._next = got
                self._end = self._next + _ARENA_BYTES
            offset = self._next
            self._next = offset + -(-nbytes // _ALIGN) * _ALIGN
            return torch.frombuffer(self._mm, dtype=torch.uint8, count=nbytes, offset=offset)


_arena = _Arena()


def empty_hugepage(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor, on huge pages where the kernel allows: from
    4 MiB on in a mapping of its own (2 MiB-aligned), smaller ones from a shared one."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0 or not hugepages_enabled():
        return torch.empty(shape, dtype=dtype)
    if nbytes < _MIN_BYTES:
        raw = _arena.take(nbytes)
    else:
        got = _huge_mapping(nbytes)
        raw = None if got is None else torch.frombuffer(got[0], dtype=torch.uint8, count=nbytes, offset=got[1])
    if raw is None:
        return torch.empty(shape, dtype=dtype)
    return raw.view(dtype).view(shape)
