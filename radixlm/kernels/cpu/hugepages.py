"""Ask Linux for transparent huge pages (2 MiB) under a large CPU tensor.

The decode step streams the whole KV pool slice of each layer and every weight from DRAM;
with 4 KiB pages that is a TLB miss every 4 KiB. Where THP is in "madvise" mode (the usual
distribution default, and this machine's) memory is only backed by huge pages after
madvise(MADV_HUGEPAGE), so large buffers that are allocated once (KV pool, packed weights)
are advised right after allocation, before their pages are first touched.

Only pages first touched after the advice are affected: buffers above glibc's mmap
threshold (the KV pool, a large LM head) are fresh mappings and get huge pages; small ones
may be carved from heap memory that is already backed, where the advice changes nothing.

RADIXLM_HUGEPAGES=0 turns it off. Anywhere else (not Linux, not CPU, small tensors) it is a
no-op that returns False.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

import torch

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_libc = None


def _madvise():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc.madvise.restype = ctypes.c_int
    return _libc.madvise


def advise_hugepages(t: torch.Tensor) -> bool:
    """madvise(MADV_HUGEPAGE) over the whole 2 MiB pages inside t's storage; True if done."""
    if os.environ.get("RADIXLM_HUGEPAGES", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    if t.device.type != "cpu" or not t.is_contiguous():
        return False
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    first = (start + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
    last = end // HUGE_PAGE * HUGE_PAGE
    if last - first < HUGE_PAGE:
        return False
    try:
        return _madvise()(first, last - first, _MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):
        return False


def empty_hugepage(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.empty on the CPU, advised for huge pages before anything touches it."""
    t = torch.empty(shape, dtype=dtype)
    advise_hugepages(t)
    return t
