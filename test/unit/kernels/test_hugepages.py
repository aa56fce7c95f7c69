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


def test_disabled_is_plain_torch_empty(monkeypatch):
    monkeypatch.setenv("RADIXLM_HUGEPAGES", "0")
    for shape in ((1000,), (4 * HUGE_PAGE,)):
        t = empty_hugepage(shape, torch.int8)
        assert t.shape == shape and t.is_contiguous()
    assert empty_hugepage((0, 5), torch.float32).shape == (0, 5)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the shared mappings are Linux only")
def test_small_buffers_are_consecutive_pieces_of_one_mapping():
    pieces = [empty_hugepage((n,), torch.int8) for n in (1000, 64, 1, 300_000)]
    for t in pieces:
        assert t.data_ptr() % 64 == 0
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel()) for t in pieces)
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:])), "pieces overlap"
    # Taken one after the other (a new mapping only when one is full: not for 0.3 MB).
    assert spans[-1][1] - spans[0][0] < 2 * HUGE_PAGE
    for i, t in enumerate(pieces):
        t.fill_(i + 1)
    for i, t in enumerate(pieces):
        assert int(t.min()) == int(t.max()) == i + 1, "a piece was written through another"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the shared mappings are Linux only")
def test_a_piece_outlives_the_others_and_a_full_mapping_moves_on():
    keep = empty_hugepage((1000,), torch.float32)
    keep.fill_(7)
    others = [empty_hugepage((HUGE_PAGE // 2,), torch.int8) for _ in range(80)]  # 40 MiB: past one mapping
    ptrs = sorted(t.data_ptr() for t in others)
    assert ptrs[-1] - ptrs[0] > 16 * HUGE_PAGE
    del others
    assert keep.sum().item() == 7 * 1000


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


@pytest.mark.skipif(not sys.platform.startswith("linux") or _thp_mode() not in ("always", "madvise"),
                    reason="needs Linux with transparent huge pages enabled")
def test_small_buffers_are_backed_by_huge_pages_too():
    # Each layer's packed weight is 0.3-3.5 MiB: 48 of 0.5 MiB fill 12 huge pages.
    before = _anon_huge_kb()
    pieces = [empty_hugepage((HUGE_PAGE // 4,), torch.int8) for _ in range(48)]
    for t in pieces:
        t.fill_(1)
    assert _anon_huge_kb() - before >= 6 * HUGE_PAGE // 1024
