"""Huge-page advice for large CPU buffers (KV pool, packed int8 weights)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from radixlm.kernels.cpu.hugepages import HUGE_PAGE, advise_hugepages, empty_hugepage


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


def test_small_strided_or_disabled_is_a_no_op(monkeypatch):
    assert not advise_hugepages(torch.empty(1000))
    assert not advise_hugepages(torch.empty(2 * HUGE_PAGE, dtype=torch.int8)[::2])
    monkeypatch.setenv("RADIXLM_HUGEPAGES", "0")
    assert not advise_hugepages(torch.empty(4 * HUGE_PAGE, dtype=torch.int8))


@pytest.mark.skipif(not sys.platform.startswith("linux") or _thp_mode() not in ("always", "madvise"),
                    reason="needs Linux with transparent huge pages enabled")
def test_advised_buffer_is_backed_by_huge_pages():
    # 96 MiB: above glibc's largest dynamic mmap threshold (32 MiB), so a fresh mapping whose
    # pages are first touched after the advice (as the KV pool is); a smaller buffer may be
    # carved from already-touched heap, which madvise cannot change retroactively.
    before = _anon_huge_kb()
    t = empty_hugepage((48 * HUGE_PAGE,), torch.int8)
    t.fill_(3)
    assert int(t[12345]) == 3 and t.shape == (48 * HUGE_PAGE,)
    # Huge pages are best effort (fragmented memory may refuse some); most must be there.
    assert _anon_huge_kb() - before >= 24 * HUGE_PAGE // 1024
