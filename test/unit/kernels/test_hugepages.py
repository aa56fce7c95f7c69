"""Huge-page advice for large CPU buffers (KV pool, packed int8 weights)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from radixlm.kernels.cpu.hugepages import HUGE_PAGE, empty_hugepage


def _thp_mode() -> str | None:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    return text[text.index("[") + 1:text.index("]")]


def _anon_huge_kb() -> int:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def test_small_or_disabled_is_plain_torch_empty(monkeypatch):
    small = empty_hugepage((1000,), torch.float32)
    assert small.shape == (1000,) and small.dtype == torch.float32
    monkeypatch.setenv("RADIXLM_HUGEPAGES", "0")
    t = empty_hugepage((4 * HUGE_PAGE,), torch.int8)
    assert t.shape == (4 * HUGE_PAGE,) and t.is_contiguous()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8])
def test_buffer_is_an_ordinary_aligned_tensor(dtype):
    t = empty_hugepage((3 * HUGE_PAGE // 4, 3), dtype)
    assert t.shape == (3 * HUGE_PAGE // 4, 3) and t.dtype == dtype and t.is_contiguous()
    if sys.platform.startswith("linux"):
        assert t.data_ptr() % HUGE_PAGE == 0
    t.fill_(2)
    view = t[5:9]
    del t  # the mapping lives as long as any view of it
    assert view.float().sum().item() == 2 * 4 * 3


@pytest.mark.skipif(not sys.platform.startswith("linux") or _thp_mode() not in ("always", "madvise"),
                    reason="needs Linux with transparent huge pages enabled")
def test_buffer_is_backed_by_huge_pages_even_after_big_frees():
    # A long-running process (the test suite, a server after loading weights) has large free
    # heap areas that torch.empty would reuse with small pages already behind them.
    junk = [torch.ones(40 * HUGE_PAGE, dtype=torch.int8) for _ in range(3)]
    del junk
    before = _anon_huge_kb()
    t = empty_hugepage((24 * HUGE_PAGE,), torch.int8)
    t.fill_(3)
    assert int(t[12345]) == 3
    # Huge pages are best effort (fragmented memory may refuse some); most must be there.
    assert _anon_huge_kb() - before >= 12 * HUGE_PAGE // 1024
