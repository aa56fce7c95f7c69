"""KV movement kernels: store new K/V into the pool, and batched row gather/scatter
across all layers' buffers (the device side of HiCache page copies).

Rows: a pool buffer is [num_slots, Hkv, D] with each slot's Hkv * D values contiguous,
so one slot is one flat row; kernels copy rows in BLOCK-element chunks (grid axis 1),
so they work for any head count and head dim.

gather/scatter take a *list* of buffers (e.g. every layer's K then every layer's V) and
read their base addresses from an int64 pointer table, so moving a page set for the
whole model is one launch instead of 2 * num_layers.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(KBuf, VBuf, loc, K, V, row_numel, stride_kbn, stride_vbn, stride_kn, stride_vn,
                     BLOCK: tl.constexpr):
    i = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < row_numel
    slot = tl.load(loc + i).to(tl.int64)
    k = tl.load(K + i * stride_kn + offs, mask=mask)
    v = tl.load(V + i * stride_vn + offs, mask=mask)
    tl.store(KBuf + slot * stride_kbn + offs, k.to(KBuf.dtype.element_ty), mask=mask)
    tl.store(VBuf + slot * stride_vbn + offs, v.to(VBuf.dtype.element_ty), mask=mask)


def _check_rows(t: torch.Tensor, name: str) -> int:
    """Elements per row; each row (everything after dim 0) must be contiguous."""
    row = math.prod(t.shape[1:])
    expect = 1
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:])):
        if size > 1 and stride != expect:
            raise ValueError(f"{name}: each row must be contiguous (strides {t.stride()})")
        expect *= size
    return row


def store_kv(k_buffer: torch.Tensor, v_buffer: torch.Tensor, loc: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor, block: int = 1024) -> None:
    """k_buffer[loc[i]] = k[i], v_buffer[loc[i]] = v[i] (cast to the pool dtype), one launch.

    Slots must not repeat (allocator invariant), except the padding slot 0 whose content
    nobody reads.
    """
    n = loc.numel()
    if n == 0:
        return
    row = _check_rows(k_buffer, "k_buffer")
    for t, name in ((v_buffer, "v_buffer"), (k, "k"), (v, "v")):
        if _check_rows(t, name) != row:
            raise ValueError(f"{name}: row size differs from the pool's {row}")
    block = min(block, triton.next_power_of_2(row))
    _store_kv_kernel[(n, triton.cdiv(row, block))](
        k_buffer, v_buffer, loc, k, v, row, k_buffer.stride(0), v_buffer.stride(0),
        k.stride(0), v.stride(0), BLOCK=block)


@triton.jit
def _gather_rows_kernel(ptrs, slots, Out, row_numel, stride_bn, stride_ob, stride_on,
                        BLOCK: tl.constexpr):
    i = tl.program_id(0)  # row of the page set
    buf = tl.program_id(1)  # which buffer (layer x K/V)
    offs = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < row_numel
    base = tl.load(ptrs + buf).to(tl.pointer_type(Out.dtype.element_ty))
    slot = tl.load(slots + i).to(tl.int64)
    x = tl.load(base + slot * stride_bn + offs, mask=mask)
    tl.store(Out + buf * stride_ob + i * stride_on + offs, x, mask=mask)


@triton.jit
def _scatter_rows_kernel(ptrs, slots, Src, row_numel, stride_bn, stride_sb, stride_sn,
                         BLOCK: tl.constexpr):
    i = tl.program_id(0)
    buf = tl.program_id(1)
    offs = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < row_numel
    base = tl.load(ptrs + buf).to(tl.pointer_type(Src.dtype.element_ty))
    slot = tl.load(slots + i).to(tl.int64)
    x = tl.load(Src + buf * stride_sb + i * stride_sn + offs, mask=mask)
    tl.store(base + slot * stride_bn + offs, x, mask=mask)


class BufferTable:
    """The int64 address table of a fixed list of same-shaped, same-dtype buffers.

    Build it once (e.g. per KV pool) and reuse it: the addresses stay valid as long as
    the buffers live, and rebuilding would cost a host-to-device copy per transfer.
    """

    def __init__(self, bufs: list[torch.Tensor]) -> None:
        if not bufs:
            raise ValueError("empty buffer list")
        first = bufs[0]
        for b in bufs:
            if b.shape != first.shape or b.stride() != first.stride() or b.dtype != first.dtype \
                    or b.device != first.device:
                raise ValueError("all buffers must share shape, strides, dtype and device")
        self.bufs = list(bufs)  # keeps the memory alive while the table is in use
        self.row_numel = _check_rows(first, "buffer")
        self.stride = first.stride(0)
        self.dtype = first.dtype
        self.device = first.device
        self.ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64, device=first.device)


def gather_rows(table: BufferTable, slots: torch.Tensor, out: torch.Tensor | None = None,
                block: int = 1024) -> torch.Tensor:
    """out[j, i] = table.bufs[j][slots[i]] as a [len(bufs), n, *row] staging block."""
    n = slots.numel()
    shape = (len(table.bufs), n, *table.bufs[0].shape[1:])
    if out is None:
        out = torch.empty(shape, dtype=table.dtype, device=table.device)
    elif tuple(out.shape) != shape or out.dtype != table.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {table.dtype} tensor of shape {shape}")
    if n == 0:
        return out
    block = min(block, triton.next_power_of_2(table.row_numel))
    _gather_rows_kernel[(n, len(table.bufs), triton.cdiv(table.row_numel, block))](
        table.ptrs, slots, out, table.row_numel, table.stride, out.stride(0), out.stride(1),
        BLOCK=block)
    return out


def scatter_rows(table: BufferTable, slots: torch.Tensor, src: torch.Tensor, block: int = 1024) -> None:
    """table.bufs[j][slots[i]] = src[j, i] (inverse of gather_rows)."""
    n = slots.numel()
    shape = (len(table.bufs), n, *table.bufs[0].shape[1:])
    if tuple(src.shape) != shape or src.dtype != table.dtype or not src.is_contiguous():
        raise ValueError(f"src must be a contiguous {table.dtype} tensor of shape {shape}")
    if n == 0:
        return
    block = min(block, triton.next_power_of_2(table.row_numel))
    _scatter_rows_kernel[(n, len(table.bufs), triton.cdiv(table.row_numel, block))](
        table.ptrs, slots, src, table.row_numel, table.stride, src.stride(0), src.stride(1),
        BLOCK=block)
