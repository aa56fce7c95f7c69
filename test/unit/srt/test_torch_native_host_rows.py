"""torch_native reads req_to_token through the batch's host copy of its pool rows.

The runner keeps req_to_token on the host and the batch's vectors on the compute device; on a
GPU the device copy of req_pool_indices cannot index the host table (every request failed
with "index is on cuda:0, different from other tensors on cpu", seen on an H200). Here the
device copy is poisoned (rows of other requests): every path (grouped decode, shared-prefix
decode, extend over a prefix, extend over a shared prefix) must give what it gives with the
true rows, which only holds when it reads req_pool_indices_cpu.
"""
from __future__ import annotations

import pytest
import torch

from radixlm.srt.model_runner.attention.torch_native import TorchNativeAttention
from radixlm.srt.model_runner.forward_batch import ForwardBatch, ForwardMode
from radixlm.srt.model_runner.kv_pool import MHATokenToKVPool

H, HKV, D, CAP = 4, 2, 16, 1300


def _world(shared: int, gen: torch.Generator):
    pool = MHATokenToKVPool(CAP, 1, HKV, D, torch.float32, "cpu")
    pool.k_buffer[0][1:] = torch.randn(CAP, HKV, D, generator=gen)
    pool.v_buffer[0][1:] = torch.randn(CAP, HKV, D, generator=gen)
    perm = torch.randperm(CAP, generator=gen) + 1
    table = torch.zeros(6, 200, dtype=torch.int64)
    table[:, :shared] = perm[:shared]  # every row starts with the same slots (0 = none shared)
    table[:, shared:] = perm[shared:shared + 6 * (200 - shared)].view(6, 200 - shared)
    return pool, table


# (mode, pool rows, prefix lens, new tokens per request, shared prefix slots)
CASES = {
    "decode_groups": (ForwardMode.DECODE, [4, 1, 3], [5, 150, 40], [1, 1, 1], 0),
    "decode_shared_prefix": (ForwardMode.DECODE, [4, 1, 3], [90, 100, 95], [1, 1, 1], 80),
    "extend_over_prefix": (ForwardMode.EXTEND, [4, 1, 3], [7, 0, 30], [5, 9, 2], 0),
    "extend_over_shared_prefix": (ForwardMode.EXTEND, [4, 1, 3], [80, 82, 80], [1, 4, 9], 80),
}


@pytest.mark.parametrize("case", list(CASES))
def test_torch_native_reads_the_table_by_host_rows(case):
    mode, rows, prefix, ext, shared = CASES[case]
    gen = torch.Generator().manual_seed(7)
    pool, table = _world(shared, gen)
    loc = torch.cat([table[r, p:p + e] for r, p, e in zip(rows, prefix, ext)])
    n = len(loc)
    q = torch.randn(n, H, D, generator=gen)
    k, v = torch.randn(n, HKV, D, generator=gen), torch.randn(n, HKV, D, generator=gen)
    backend = TorchNativeAttention(pool, H, HKV, D)

    def run(poison: bool) -> torch.Tensor:
        fb = ForwardBatch.build(mode, [0] * n, loc, rows, prefix, ext, table)
        if poison:  # the device copy names other requests' rows; the host copy stays true
            fb.req_pool_indices = torch.tensor([0, 5, 2])
        backend.init_forward_metadata(fb)
        if shared:
            assert fb.attn_metadata.shared_index is not None, "the shared-prefix path was not taken"
        return backend.forward(q, k, v, 0, fb, D ** -0.5)

    torch.testing.assert_close(run(poison=True), run(poison=False), rtol=0, atol=0)
