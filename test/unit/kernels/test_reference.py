"""The torch twins, index builders and host-only page copies (no triton needed).

The twins are the definition the Triton kernels are tested against, so they are checked
here against independent formulations: the torch_native backend (SDPA) for attention,
plain Python for the indices.
"""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from radixlm.kernels.indices import build_indptr, build_kv_indices
from radixlm.kernels.page_copy import PageCopier
from radixlm.kernels.reference import (decode_attention_ref, extend_attention_ref, gather_rows_ref,
                                       scatter_rows_ref, store_kv_ref)
from radixlm.srt.model_runner.attention.base import create_attention_backend
from radixlm.srt.model_runner.attention.torch_native import TorchNativeAttention
from radixlm.srt.model_runner.forward_batch import ForwardBatch, ForwardMode
from test.support.kernel_batches import place_tokens, random_qkv
from radixlm.srt.model_runner.kv_pool import MHATokenToKVPool


def test_package_import_does_not_import_triton():
    code = ("import sys, radixlm.kernels, radixlm.kernels.indices, radixlm.kernels.reference, "
            "radixlm.kernels.page_copy; assert 'triton' not in sys.modules, 'triton imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_indices_follow_req_to_token():
    req_to_token = torch.arange(40).view(4, 10) + 100
    rows, lens = torch.tensor([2, 0, 3]), torch.tensor([3, 0, 5])
    assert build_indptr(lens).tolist() == [0, 3, 3, 8]
    assert build_indptr(lens).dtype == torch.int32
    got = build_kv_indices(req_to_token, rows, lens)
    assert got.tolist() == [120, 121, 122, 130, 131, 132, 133, 134]
    assert build_kv_indices(req_to_token, rows, torch.zeros(3, dtype=torch.int64)).numel() == 0
    assert build_kv_indices(req_to_token, rows, lens, dtype=torch.int32).dtype == torch.int32


def _world(heads, kv_heads, dim, cap=256):
    pool = MHATokenToKVPool(cap, 1, kv_heads, dim, torch.float32)
    pool.k_buffer[0][1:] = float("nan")
    pool.v_buffer[0][1:] = float("nan")
    return pool, TorchNativeAttention(pool, heads, kv_heads, dim)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (8, 1)])
def test_twins_match_torch_native(heads, kv_heads):
    """A prefill, an extend over cached prefixes, then a decode: the twins (fed the CSR
    indices the triton backend builds) equal torch_native on the same pool."""
    dim = 16
    pool, backend = _world(heads, kv_heads, dim)
    gen = torch.Generator().manual_seed(heads)
    req_to_token = torch.zeros(3, 64, dtype=torch.int64)
    free = (torch.randperm(256, generator=gen) + 1).tolist()
    lens = [0, 0, 0]
    for mode, rows, ext in [(ForwardMode.EXTEND, [0, 1], [5, 1]),
                            (ForwardMode.EXTEND, [2, 0, 1], [3, 1, 8]),
                            (ForwardMode.DECODE, [0, 1, 2], [1, 1, 1])]:
        n = sum(ext)
        loc, prefix = place_tokens(req_to_token, free, lens, rows, ext)
        q, k, v = random_qkv(gen, n, heads, kv_heads, dim)
        fb = ForwardBatch.build(mode, [0] * n, loc, rows, prefix, ext, req_to_token)
        backend.init_forward_metadata(fb)
        want = backend.forward(q, k, v, 0, fb, dim ** -0.5)  # also stores k, v in the pool
        k_buf, v_buf = pool.get_kv(0)
        if mode == ForwardMode.DECODE:
            got = decode_attention_ref(q, k_buf, v_buf, build_indptr(fb.seq_lens),
                                       build_kv_indices(req_to_token, fb.req_pool_indices, fb.seq_lens),
                                       dim ** -0.5)
        else:
            got = extend_attention_ref(q, k, v, k_buf, v_buf, build_indptr(fb.extend_seq_lens),
                                       build_indptr(fb.extend_prefix_lens),
                                       build_kv_indices(req_to_token, fb.req_pool_indices,
                                                        fb.extend_prefix_lens), dim ** -0.5)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_store_and_row_twins():
    k_buf, v_buf = torch.zeros(6, 2, 4), torch.zeros(6, 2, 4, dtype=torch.float16)
    k, v = torch.randn(2, 2, 4), torch.randn(2, 2, 4)
    store_kv_ref(k_buf, v_buf, torch.tensor([4, 1]), k, v)
    assert torch.equal(k_buf[4], k[0]) and torch.equal(v_buf[1], v[1].half())
    bufs = [torch.randn(5, 3) for _ in range(3)]
    rows = gather_rows_ref(bufs, torch.tensor([4, 0]))
    assert rows.shape == (3, 2, 3) and torch.equal(rows[2, 0], bufs[2][4])
    scatter_rows_ref(bufs, torch.tensor([1, 2]), rows)
    assert torch.equal(bufs[1][1], bufs[1][4]) and torch.equal(bufs[0][2], bufs[0][0])


def test_page_copier_host_only():
    dev = [torch.randn(10, 2, 4) for _ in range(4)]
    host = [torch.zeros(20, 2, 4) for _ in range(4)]
    copier = PageCopier(dev, host)  # CPU "device": torch path, triton untouched
    copier.device_to_host(torch.tensor([3, 9]), torch.tensor([19, 0]))
    assert all(torch.equal(h[19], d[3]) and torch.equal(h[0], d[9]) for d, h in zip(dev, host))
    copier.host_to_device(torch.tensor([19]), torch.tensor([5]))
    assert all(torch.equal(d[5], d[3]) for d in dev)
    with pytest.raises(ValueError):
        copier.device_to_host(torch.tensor([1]), torch.tensor([1, 2]))
    with pytest.raises(ValueError):
        PageCopier(dev, [torch.zeros(20, 2, 5) for _ in range(4)])


def test_flashinfer_backend_reports_missing_package_or_cpu():
    pool = MHATokenToKVPool(8, 1, 2, 16, torch.float16)
    try:
        import flashinfer  # noqa: F401
        expected: type[Exception] = ValueError  # installed: refuses the CPU pool instead
        match = "CUDA"
    except ImportError:
        expected, match = ImportError, "flashinfer-python"
    with pytest.raises(expected, match=match):
        create_attention_backend("flashinfer", pool, 4, 2, 16)


def test_triton_backend_refuses_cpu_without_interpreter():
    pytest.importorskip("triton")
    code = ("import os; os.environ.pop('TRITON_INTERPRET', None)\n"
            "import torch\n"
            "from radixlm.srt.model_runner.attention.base import create_attention_backend\n"
            "from radixlm.srt.model_runner.kv_pool import MHATokenToKVPool\n"
            "try:\n"
            "    create_attention_backend('triton', MHATokenToKVPool(8, 1, 2, 16, torch.float32), 4, 2, 16)\n"
            "except ValueError as e:\n"
            "    assert 'CUDA' in str(e)\n"
            "else:\n"
            "    raise SystemExit('no error')\n")
    subprocess.run([sys.executable, "-c", code], check=True)
