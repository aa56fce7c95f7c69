"""The request-to-token table's native helpers (radixlm/kernels/cpu/table_ops.cpp) against
their torch formulations: a decode step's CSR rows (kernels/indices.py) and the slots that a
batch's rows share (torch_native's shared-prefix check)."""
from __future__ import annotations

import pytest
import torch

from radixlm.kernels.cpu import ops
from radixlm.kernels.indices import build_indptr, build_kv_indices

pytestmark = [pytest.mark.skipif(not ops.available(), reason="native CPU kernels could not be built"),
              pytest.mark.usefixtures("kernel_isa")]


@pytest.mark.parametrize("lens", [[5], [0, 3, 0], [17, 1, 64, 40], [64] * 8])
def test_decode_rows_matches_torch(lens):
    g = torch.Generator().manual_seed(len(lens))
    table = torch.randint(1, 1000, (10, 64), generator=g)
    rows = torch.randperm(10, generator=g)[:len(lens)]
    lens_t = torch.tensor(lens, dtype=torch.int64)
    indptr, indices = ops.decode_rows(table, rows, lens_t, sum(lens))
    assert torch.equal(indptr, build_indptr(lens_t, torch.int64))
    assert torch.equal(indices, build_kv_indices(table, rows, lens_t, max(lens)))


def test_decode_rows_refuses_what_is_outside_the_table():
    table = torch.arange(40, dtype=torch.int64).view(4, 10)
    ok_rows = torch.tensor([0, 3])
    assert ops.decode_rows(table, torch.tensor([0, 4]), torch.tensor([1, 1]), 2) is None  # row 4 of 4
    assert ops.decode_rows(table, torch.tensor([0, -1]), torch.tensor([1, 1]), 2) is None
    assert ops.decode_rows(table, ok_rows, torch.tensor([1, 11]), 12) is None  # wider than the table
    assert ops.decode_rows(table, ok_rows, torch.tensor([2, 3]), 4) is None  # room for 4, 5 keys
    assert ops.decode_rows(table, ok_rows, torch.tensor([2, 3]), 6) is None  # a total that is not the sum
    assert ops.decode_rows(table.to(torch.int32), ok_rows, torch.tensor([2, 3]), 5) is None
    indptr, indices = ops.decode_rows(table, ok_rows, torch.tensor([2, 3]), 5)
    assert indices.tolist() == [0, 1, 30, 31, 32] and indptr.tolist() == [0, 2, 5]


@pytest.mark.parametrize("common,limit", [(0, 10), (4, 10), (10, 10), (7, 5), (3, 0)])
def test_common_prefix(common, limit):
    table = torch.arange(60, dtype=torch.int64).view(6, 10)
    rows = torch.tensor([1, 4, 2])
    table[rows, :common] = torch.arange(100, 100 + common)
    assert ops.common_prefix(table, rows, limit) == min(common, limit)
    assert ops.common_prefix(table, rows[:1], limit) == limit  # one row shares all of itself
    assert ops.common_prefix(table, torch.tensor([1, 6]), limit) is None
    assert ops.common_prefix(table, rows, 11) is None
